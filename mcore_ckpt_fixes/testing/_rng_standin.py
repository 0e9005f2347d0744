"""CPU stand-ins for a GPU's generators (worker processes only).

:class:`CudaRngStandIn`: one CPU generator plays this process's CUDA generator (``torch.cuda``'s RNG
functions and ``default_generators``), so that Megatron's RNG tracker and its checkpointed CUDA
state are real per rank without a GPU. :class:`TrainingRngStandIn`, for training:

On a GPU, dropout and ``normal_()`` on activations draw from the CUDA default generator, which
Megatron's RNG tracker swaps for a named stream inside ``tracker.fork(name)``; the CPU generator
(``torch.get_rng_state``) is a separate stream, and the tracker checks that a fork leaves it alone.
On a CPU host every op on a CPU tensor draws from torch's default generator. So here torch's
default generator plays the CUDA generator (the tracker's swaps then really change what dropout
draws), and a second generator plays the CPU one for ``torch.get_rng_state`` /
``torch.set_rng_state`` / ``torch.manual_seed`` (which seeds both, as torch does with a GPU).
With CUDA present nothing is stood in for.
"""

from __future__ import annotations

import torch


class _AnyIndex:
    """``torch.cuda.default_generators`` for the stand-in: every index is the one generator."""

    def __init__(self, gen):
        self.gen = gen

    def __getitem__(self, index):
        return self.gen

    def __len__(self):
        return 1


class CudaRngStandIn:
    """Context manager: one CPU generator plays this process's CUDA default generator (see module
    doc), and ``torch.tensor(..., device="cuda")`` makes a CPU tensor. Does nothing where CUDA is
    available."""

    def __init__(self, generator=None):
        # ``generator``: the one to play the CUDA generator (torch's default one, so that CPU
        # dropout draws from the stream a tracker fork swaps in), kept at its state; by default a
        # fresh generator at torch's default CUDA seed.
        self.gen = None
        self._generator = generator
        self._saved = []

    def _set(self, owner, name, value):
        self._saved.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, value)

    def __enter__(self):
        if torch.cuda.is_available():
            return self
        import torch.cuda.random as cuda_random
        from megatron.core.tensor_parallel import random as mrandom

        gen = self.gen = self._generator
        if gen is None:
            gen = self.gen = torch.Generator()
            gen.manual_seed(67280421310721)  # torch's default CUDA seed: a fresh process starts there

        def get_rng_state(device="cuda"):
            return gen.get_state()

        def set_rng_state(new_state, device="cuda"):
            gen.set_state(new_state.clone())  # torch.cuda.set_rng_state copies too

        def manual_seed(seed):
            gen.manual_seed(int(seed))

        for owner in (torch.cuda, cuda_random):
            self._set(owner, "get_rng_state", get_rng_state)
            self._set(owner, "set_rng_state", set_rng_state)
            self._set(owner, "manual_seed", manual_seed)
        self._set(torch.cuda, "default_generators", _AnyIndex(gen))
        # Megatron's _set_cuda_rng_state queues its setter with the `_lazy_call` it imported from
        # torch.cuda; without CUDA the queue never runs. Run it now (it then uses the stand-in).
        self._set(mrandom, "_lazy_call", lambda callable, **kwargs: callable())
        # load_checkpoint's read_metadata all-reduces the tracker's iteration in a CUDA tensor.
        real_tensor = torch.tensor

        def tensor(data, *args, device=None, **kwargs):
            if device is not None and torch.device(device).type == "cuda":
                device = "cpu"
            return real_tensor(data, *args, device=device, **kwargs)

        self._set(torch, "tensor", tensor)
        return self

    def __exit__(self, *exc):
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()
        return False

    def draw(self, n):
        """n values from "the CUDA generator" (the stand-in, or the real one on a GPU)."""
        if self.gen is not None:
            return torch.rand(n, generator=self.gen)
        return torch.rand(n, device="cuda").cpu()


# -- Megatron setup ---------------------------------------------------------------------------------


class TrainingRngStandIn(CudaRngStandIn):
    def __init__(self):
        super().__init__(generator=torch.default_generator)
        self.cpu = None

    def __enter__(self):
        super().__enter__()
        if torch.cuda.is_available():
            return self
        cpu = self.cpu = torch.Generator()
        cpu.set_state(torch.default_generator.get_state())
        cuda_seed = torch.cuda.manual_seed  # the stand-in's, set by CudaRngStandIn

        def get_rng_state():
            return cpu.get_state()

        def set_rng_state(new_state):
            cpu.set_state(new_state)

        def manual_seed(seed):
            cpu.manual_seed(int(seed))
            cuda_seed(int(seed))
            return cpu

        import torch.random as torch_random

        for owner in (torch, torch_random):
            self._set(owner, "get_rng_state", get_rng_state)
            self._set(owner, "set_rng_state", set_rng_state)
            self._set(owner, "manual_seed", manual_seed)
        return self

    def cpu_generator(self):
        """The generator CPU-side sampling (a data loader's shuffle) draws from."""
        return self.cpu if self.cpu is not None else torch.default_generator


def fork_draws(rank, world_size):
    """A world entry point proving the stand-in real on this stack: what CPU ops draw inside and
    after ``tracker.fork``, and the CPU generator before and after it. Inside the fork the draws
    must come from the tracker's stream, after it from the default stream where it was, and the CPU
    generator must not move (a fork that only keeps bookkeeping fails the first)."""
    from megatron.core import tensor_parallel

    with TrainingRngStandIn():
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.reset()
        torch.manual_seed(1)  # seeds the CPU generator and the CUDA one, as torch does
        tracker.add("a", 2)
        cpu_before = torch.get_rng_state().clone()
        with tracker.fork("a"):
            inside = torch.rand(8)
            dropped = torch.nn.functional.dropout(torch.ones(8), 0.5)
        after = torch.rand(8)
        cpu_after = torch.get_rng_state().clone()
        tracker.reset()
    return {"inside": inside, "dropped": dropped, "after": after, "cpu_before": cpu_before, "cpu_after": cpu_after}
