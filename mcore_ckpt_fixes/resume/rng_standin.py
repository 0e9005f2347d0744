"""CPU stand-in for a GPU's two generators, as training draws from them (worker processes only).

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

from ..fixes.rng_under_ep.checks.core import CudaRngStandIn


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
