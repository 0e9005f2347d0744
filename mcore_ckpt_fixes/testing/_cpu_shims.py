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


def cuda_to_cpu_mode():
    """A TorchFunctionMode that sends tensors created with ``device="cuda"`` to the CPU.

    Megatron's optimizer classes allocate small bookkeeping tensors with ``device='cuda'``
    (``MixedPrecisionOptimizer._dummy_overflow_buf``, ``DistributedOptimizer``'s state allocation
    on load) and accept parameters only when ``param.type()`` names a ``torch.cuda`` type;
    :func:`install` covers ``torch.cuda.current_device()`` but not these. The mode maps
    ``device="cuda"`` to the CPU, makes ``Tensor.cuda()`` a no-op and reports a CPU tensor's
    ``type()`` under its CUDA name. Entered only around a scenario's own calls, in the worker,
    on a CPU run.
    """
    import torch
    from torch.overrides import TorchFunctionMode

    def is_cuda(dev):
        return (isinstance(dev, str) and dev.startswith("cuda")) or (
            isinstance(dev, torch.device) and dev.type == "cuda"
        )

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if is_cuda(kwargs.get("device")):
                kwargs = dict(kwargs, device="cpu")
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                # DistributedOptimizer sorts parameters by ``param.type()`` and accepts only
                # ``torch.cuda.*Tensor``: report the CPU tensors by their CUDA names.
                name = func(*args)
                return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
            if func is torch.distributed.all_to_all_single:
                # MoE's all-to-all dispatcher moves its split sizes to the host as NumPy arrays
                # only when they are on a GPU; on the CPU they stay tensors, which the collective's
                # binding refuses: hand it the lists the GPU path ends with.
                args = tuple(a.tolist() if i in (2, 3) and torch.is_tensor(a) else a for i, a in enumerate(args))
                kwargs = {
                    k: v.tolist() if k.endswith("split_sizes") and torch.is_tensor(v) else v for k, v in kwargs.items()
                }
            if func is torch.Tensor.to and any(is_cuda(a) for a in args[1:]):
                args = tuple("cpu" if is_cuda(a) else a for a in args)
            return func(*args, **kwargs)

    return CudaToCpu()


class NoEvent:
    """An event of a :class:`NoStream`: already reached."""

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True


class NoStream:
    """What ``torch.cuda.current_stream()`` hands back on a CPU run: CPU work is ordered already."""

    def record_event(self, event=None):
        # MoE's all-to-all dispatcher records the copy of its token counts to the host on a stream
        # of its own, and waits for that event later.
        return event if event is not None else NoEvent()

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass


def cpu_streams():
    """Context manager: ``torch.cuda.current_stream()``, ``torch.cuda.Stream()`` and
    ``torch.cuda.stream(s)`` work on a CPU run.

    Megatron's DDP orders its gradient reduce-scatter after the backward with the current CUDA
    stream (``param_and_grad_buffer.start_grad_sync``); on a CPU every op is already ordered, so
    the stream is one that waits for nothing. Entered only around a scenario's own calls, in the
    worker, on a CPU run."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def swapped():
        saved = torch.cuda.current_stream, torch.cuda.stream, torch.cuda.Stream
        torch.cuda.current_stream = lambda device=None: NoStream()
        torch.cuda.stream = lambda stream: contextlib.nullcontext()
        # megatron.training's get_model wraps its chunks in DDP on a stream of their own.
        torch.cuda.Stream = lambda *args, **kwargs: NoStream()
        try:
            yield
        finally:
            torch.cuda.current_stream, torch.cuda.stream, torch.cuda.Stream = saved

    return swapped()
