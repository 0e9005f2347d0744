"""Let Megatron-Core's CUDA-only calls run on a CPU-only host (gloo worlds in test workers).

Only what the checkpoint round trips actually reach is shimmed; :func:`install` is called by the
test worker of a gloo world, never at package import, and does nothing where CUDA is usable.
"""

from __future__ import annotations

_INSTALLED = False


def install() -> None:
    global _INSTALLED
    import torch

    if _INSTALLED or torch.cuda.is_available():
        return
    cuda = torch.cuda
    # Modules built with ``device=torch.cuda.current_device()`` (MambaMixer's conv1d, dt_bias,
    # A_log, D, norm) must land on the CPU.
    cuda.current_device = lambda: torch.device("cpu")
    # dist_checkpointing's FileSystemWriterAsync syncs after its (here CPU -> CPU) copies.
    cuda.synchronize = lambda device=None: None
    # Megatron's RNG tracker (model_parallel_cuda_manual_seed, tracker.fork() around MambaMixer's
    # init) reads CUDA RNG states; hand it the CPU generator's. Its writes (torch.cuda.manual_seed,
    # _set_cuda_rng_state) go through torch's lazy-call queue, which only runs once CUDA
    # initialises, i.e. never here: the tracker then works as bookkeeping only and all values come
    # from the CPU generator (use_cpu_initialization).
    get_rng_state = lambda device="cuda": torch.get_rng_state()  # noqa: E731
    cuda.get_rng_state = cuda.random.get_rng_state = get_rng_state
    _INSTALLED = True
