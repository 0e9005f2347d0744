"""Collectives of CUDA tensors in a gloo world on a GPU host: the resume check's ranks (its worlds
are gloo worlds), and the round trips of a world with more ranks than GPUs (NCCL refuses two ranks
on one device, so they share the GPU over gloo).

Gloo reduces and broadcasts CUDA tensors, but Megatron's distributed optimizer gathers its
parameters with a coalesced all-gather of CUDA tensors (``torch.distributed._coalescing_manager``
around ``all_gather_into_tensor``), which gloo ends with a segmentation fault (torch 2.11 on an
H200: every such rank died in ``start_param_sync``). So in such a rank (:func:`install`, called by
the world worker of a gloo world on a GPU host, the tests' and selftest's, never at package import):

* ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (and their older names) of CUDA tensors
  run on host copies of them and copy the result back: an all-gather moves the same bits, and a
  reduce-scatter sums in gloo's order, as it does for the CPU ranks of every other test world;
* ``_coalescing_manager`` runs each collective of its block when it is called, to completion, and
  hands back a handle that has nothing left to wait for.

What these collectives feed (the parameters, gradients and optimizer state that a checkpoint saves
and loads) stays on the GPU; only the transport between ranks goes through the host.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading

# Collectives that take (output, input, ...): run on host copies when their tensors are on a GPU.
ON_HOST = ("all_gather_into_tensor", "reduce_scatter_tensor", "_all_gather_base", "_reduce_scatter_base")
# Collectives Megatron issues inside a coalescing block: run to completion there.
IN_BLOCK = ("all_reduce",)
_STATE = threading.local()
_INSTALLED = False


def staged(tensor) -> bool:
    """Whether ``tensor`` goes through the host (its own function so that a CPU test can say yes)."""
    return tensor.is_cuda


class Completed:
    """The handle of a collective that already finished, for callers that asked for ``async_op``."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _in_block() -> bool:
    return getattr(_STATE, "depth", 0) > 0


def _to_completion(original, bound):
    """Run the bound collective synchronously; the handle its caller asked for, if it asked."""
    asked_async = bool(bound.arguments.get("async_op", False))
    bound.arguments["async_op"] = False
    original(*bound.args, **bound.kwargs)
    return Completed() if asked_async else None


def _on_host(original):
    signature = inspect.signature(original)
    out_name, in_name = list(signature.parameters)[:2]

    @functools.wraps(original)
    def collective(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        output, input_ = bound.arguments[out_name], bound.arguments[in_name]
        if not (staged(output) or staged(input_)):
            return _to_completion(original, bound) if _in_block() else original(*args, **kwargs)
        host_out = output.detach().to("cpu", copy=True)
        bound.arguments[out_name] = host_out
        bound.arguments[in_name] = input_.detach().to("cpu", copy=True)
        handle = _to_completion(original, bound)
        output.detach().copy_(host_out)
        return handle

    collective.through_host = True  # functools.wraps gives it torch's name and module
    return collective


def _finished_in_block(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args, **kwargs):
        if not _in_block():
            return original(*args, **kwargs)
        return _to_completion(original, signature.bind(*args, **kwargs))

    collective.through_host = True
    return collective


@contextlib.contextmanager
def _coalescing_manager(group=None, device=None, async_ops=False):
    """Each collective of the block finishes as it is called; the handle waits for nothing."""
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield Completed()
    finally:
        _STATE.depth -= 1


_coalescing_manager.through_host = True


def install() -> None:
    """In a rank of a gloo world on a GPU host: the collectives above, wherever torch and the modules
    imported so far (Megatron's bind ``all_gather_into_tensor`` and ``_coalescing_manager`` to names
    of their own) hold them; modules imported later take them from ``torch.distributed``."""
    global _INSTALLED
    from torch.distributed import distributed_c10d as c10d

    if _INSTALLED:
        return
    replaced = {}
    for name in ON_HOST + IN_BLOCK + ("_coalescing_manager",):
        original = getattr(c10d, name, None)
        if original is None:
            continue
        if name == "_coalescing_manager":
            replaced[original] = _coalescing_manager
        elif name in ON_HOST:
            replaced[original] = _on_host(original)
        else:
            replaced[original] = _finished_in_block(original)
    # By the names sys.modules files them under: not everything filed there is a module with a
    # __name__ of its own (a Cython extension's parallel helper, say).
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("torch.distributed", "megatron")):
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in items:
            try:
                new = replaced.get(value)
            except TypeError:  # an unhashable module attribute
                continue
            if new is not None:
                setattr(module, attr, new)
    _INSTALLED = True
