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
