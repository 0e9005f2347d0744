"""Megatron's ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``) on a CPU host, for round trips
of its checkpoint (test and selftest worker processes only).

No tensor is on a GPU here. The hybrid optimizer decides what to offload by ``param.is_cuda`` and
overlaps its copies on CUDA streams: :func:`on_device` makes a registered model's parameters report
``is_cuda``, so it splits them as on a GPU host (a CPU copy of each, updated by CPU optimizers and
copied back; ``pin_memory`` a no-op), and stands CUDA streams and events in by objects that order
nothing (CPU work is ordered already). :func:`precision_aware_without_te` lets ``OptimizerConfig``
accept the precision-aware optimizer (which Megatron-LM requires with CPU offload) where, before
0.17, it asks Transformer Engine's version and TE is not installed.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


class _Event:
    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass


class _Stream:
    """A CUDA stream stand-in: CPU work is ordered already."""

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return _Event()

    def synchronize(self):
        pass


# What makes a new tensor of an on-device one on the same device (``to``: a dtype only), or moves it.
_DERIVING = (torch.Tensor.clone, torch.Tensor.float, torch.Tensor.to, torch.Tensor.cpu)


class _OnDevice(TorchFunctionMode):
    """Tensors whose storage is a registered model's report ``is_cuda``; pinned memory is plain."""

    def __init__(self):
        super().__init__()
        self.storages, self._kept = set(), []
        self._deriving = False

    @contextlib.contextmanager
    def deriving(self):
        """Inside the block, a tensor made from an on-device one by ``clone``, ``float`` or a
        ``to(dtype)`` is on the device too, and ``cpu()`` of one is a new CPU tensor: what a GPU host
        does where the distributed optimizer makes its fp32 main shards from the model's bf16
        shards (without the precision-aware optimizer) and the hybrid optimizer clones them to the CPU."""
        self._deriving = True
        try:
            yield self
        finally:
            self._deriving = False

    def _on_device(self, tensor) -> bool:
        if not isinstance(tensor, torch.Tensor):
            return False
        try:
            return tensor.untyped_storage().data_ptr() in self.storages
        except RuntimeError:  # a tensor without data (meta, fake): on no device of ours
            return False

    def _derived(self, func, args, kwargs):
        if func is torch.Tensor.cpu:
            return args[0].clone()
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and not self._on_device(out):
            self.register([out])
        return out

    def register(self, tensors):
        for t in tensors:
            storage = t.untyped_storage()
            self._kept.append(storage)  # alive while the mode is: no CPU tensor reuses its address
            self.storages.add(storage.data_ptr())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.is_cuda.__get__:
            return args[0].untyped_storage().data_ptr() in self.storages
        if func is torch.Tensor.pin_memory:
            return args[0]
        if self._deriving and args and self._on_device(args[0]) and func in _DERIVING:
            moves = any(isinstance(a, (str, torch.device)) for a in args[1:]) or "device" in kwargs
            if func is not torch.Tensor.to or not moves:
                return self._derived(func, args, kwargs)
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_device():
    """The mode (``.register(model.parameters())``) and CUDA stream stand-ins, on a CPU host only."""
    if torch.cuda.is_available():
        yield None
        return
    cuda = torch.cuda
    saved = cuda.current_stream, cuda.stream, cuda.Stream
    cuda.current_stream = lambda device=None: _Stream()
    cuda.stream = lambda stream: contextlib.nullcontext()
    cuda.Stream = lambda *args, **kwargs: _Stream()
    try:
        with _OnDevice() as mode:
            yield mode
    finally:
        cuda.current_stream, cuda.stream, cuda.Stream = saved


@contextlib.contextmanager
def precision_aware_without_te():
    """Before 0.17 ``OptimizerConfig`` asks Transformer Engine's version for the precision-aware
    optimizer (to pick ``store_param_remainders``), which raises without TE: answer "older than
    asked", the answer for an absent TE."""
    import megatron.core.optimizer.optimizer_config as config

    saved = config.__dict__.get("is_te_min_version")
    if saved is not None:
        config.is_te_min_version = lambda *args, **kwargs: False
    try:
        yield
    finally:
        if saved is not None:
            config.is_te_min_version = saved


@contextlib.contextmanager
def offload_path(apex=True):
    """Everything a hybrid optimizer needs on this host: Megatron's optimizer modules as with Apex
    installed (``apex``, the path a GPU host takes; else torch's fallback), the precision-aware
    optimizer accepted without Transformer Engine, and :func:`on_device` (yields its mode, or None)."""
    from ._fused_adam import optimizer_path

    with precision_aware_without_te(), optimizer_path(apex=apex), on_device() as device:
        yield device


def build_offloaded(seed, device):
    """A one-layer bf16 GPT under DDP and the distributed optimizer as Megatron-LM builds it with
    ``--optimizer-cpu-offload`` (which requires ``--use-precision-aware-optimizer``), every
    parameter's state offloaded (``--optimizer-offload-fraction 1.0``, the default); inside
    :func:`offload_path`, ``device`` its mode."""
    from megatron.core.optimizer import get_megatron_optimizer

    from .dist_optimizer import build_model, optimizer_config

    model = build_model(seed)
    if device is not None:
        device.register(model.module.parameters())
    config = optimizer_config(
        optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, use_precision_aware_optimizer=True
    )
    return model, get_megatron_optimizer(config, [model])


def deriving(device):
    """``device.deriving()`` inside :func:`offload_path` on a CPU host; nothing where ``device`` is
    None (a GPU host: the tensors are where Megatron puts them)."""
    return device.deriving() if device is not None else contextlib.nullcontext()


def build_offload_fraction(seed, device, fraction, shape=None):
    """:func:`build_offloaded` with ``--optimizer-offload-fraction fraction``: the parameters not
    offloaded are stepped by the GPU optimizer, over fp32 copies made on the device (built inside
    :func:`deriving`); ``shape``: the model's :class:`~.dist_optimizer.Shape`."""
    from megatron.core.optimizer import get_megatron_optimizer

    from .dist_optimizer import build_model, optimizer_config

    model = build_model(seed, shape=shape)
    if device is not None:
        device.register(model.module.parameters())
    config = optimizer_config(
        optimizer_cpu_offload=True, optimizer_offload_fraction=fraction, use_precision_aware_optimizer=True
    )
    with deriving(device):
        return model, get_megatron_optimizer(config, [model])


def load_offloaded(model, opt, path, fmt, device):
    """Load the ``dist_checkpointing`` save at ``path`` (sharding type ``fmt``) into ``model`` and
    ``opt`` as Megatron does: the model, then the optimizer, whose load rebuilds the sub-optimizers
    and their copies (inside :func:`deriving`)."""
    from megatron.core import dist_checkpointing

    from .dist_optimizer import request

    loaded = dist_checkpointing.load(request(model, opt, fmt, True), path)
    model.module.load_state_dict(loaded["model"])
    with deriving(device):
        opt.load_state_dict(loaded["optimizer"])


def stepped_states(model, opt, device, indices):
    """:func:`mcore_ckpt_fixes.testing.dist_optimizer.step` for each index of ``indices`` (inside
    :func:`deriving`): :func:`offloaded_state` after each."""
    from .dist_optimizer import step

    states = []
    for i in indices:
        with deriving(device):
            step(model, opt, i)
        states.append(offloaded_state(model, opt))
    return states


def offloaded_state(model, opt):
    """:func:`mcore_ckpt_fixes.testing.dist_optimizer.local_state`, and the tensor each of the hybrid
    optimizer's CPU optimizers updates (``inner/``)."""
    from .dist_optimizer import distributed, local_state

    out = local_state(model, opt)
    for name, p in model.module.named_parameters():
        for d in distributed(opt):
            inner = getattr(d.optimizer, "param_to_inner_param", None)
            if inner is not None and p in d.model_param_group_index_map:
                gi, go = d.model_param_group_index_map[p]
                out[f"inner/{name}"] = inner[d.optimizer.param_groups[gi]["params"][go]].detach().clone()
    return out
