"""CPU device meshes for round trips (test and selftest workers only).

Megatron-FSDP's adapter builds its meshes with ``device_type="cuda"``; DTensors on a CUDA mesh move
their local tensor to CUDA. :func:`cpu_device_meshes` makes the adapter build them on the CPU for
the duration of a ``with`` block (gloo worlds), and :func:`cpu_mesh` is a mesh over one group.
"""

from __future__ import annotations

import contextlib


def cpu_mesh(group):
    """A 1-D CPU ``DeviceMesh`` over the ranks of ``group``."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, "cpu")


class _CpuDeviceMesh:
    """``DeviceMesh`` as the Megatron-FSDP adapter sees it, with its meshes on the CPU: the adapter
    asks for ``device_type="cuda"``, and DTensors of a CUDA mesh move their local tensor to CUDA."""

    @staticmethod
    def from_group(*args, **kwargs):
        from torch.distributed.device_mesh import DeviceMesh

        kwargs["device_type"] = "cpu"
        return DeviceMesh.from_group(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_meshes():
    """Worker-only shim (never installed by ``import mcore_ckpt_fixes``), restored on exit."""
    import torch
    import torch.distributed.device_mesh  # noqa: F401

    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter

    saved = adapter.__dict__.get("DeviceMesh")
    if torch.cuda.is_available() or saved is None:
        yield
        return
    adapter.DeviceMesh = _CpuDeviceMesh
    try:
        yield
    finally:
        adapter.DeviceMesh = saved
