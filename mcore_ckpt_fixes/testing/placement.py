"""Where a world's tensors live: the device a scenario was asked to run on (``"cpu"`` or ``"cuda"``),
for the code that builds its models and for its result (test and selftest worker processes only).

A scenario enters :func:`on` with its ``device`` argument; what it builds reads :func:`device` (the
rank's GPU in a ``cuda`` world), and :func:`placed` adds to its result where that was, which the GPU
check asserts.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_DEVICE = contextvars.ContextVar("mcore_ckpt_fixes_testing_device", default="cpu")


def current() -> str:
    """``"cpu"`` or ``"cuda"``: the device name the scenario running in this context was given."""
    return _DEVICE.get()


def device() -> torch.device:
    """The torch device this world's models live on (the rank's GPU in a ``cuda`` world)."""
    return torch.device("cuda", torch.cuda.current_device()) if _DEVICE.get() == "cuda" else torch.device("cpu")


@contextlib.contextmanager
def on(name: str):
    """Inside the block :func:`device` is ``name``'s (``"cpu"`` or ``"cuda"``)."""
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {name!r}")
    token = _DEVICE.set(name)
    try:
        yield
    finally:
        _DEVICE.reset(token)


def placed(result: dict) -> dict:
    """A round trip's result with the device this world's models lived on (``device``)."""
    return {**result, "device": str(device())}


CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's deterministic workspace setting (read when a handle is made)


@contextlib.contextmanager
def deterministic_kernels(on_gpu: bool):
    """Inside the block, a GPU run takes deterministic kernels, as Megatron's ``--deterministic-mode``
    makes it: the resume check compares two runs bit for bit, and on a GPU an embedding's backward,
    ``index_add_`` and scatter add in whatever order their atomics land unless torch is told not to.
    ``warn_only``: an op with no deterministic kernel warns (the run goes on, and its comparison says
    whether it mattered) instead of stopping the run. On the CPU the kernels are deterministic
    already (one thread per rank): nothing changes there."""
    if not on_gpu:
        yield
        return
    import os

    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    saved_env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        if saved_env is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
