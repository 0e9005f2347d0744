"""fsdp2-swiglu-split's checkpoint side, on ``megatron.core.dist_checkpointing.serialization``: a save
with the fix marks each FSDP2 SwiGLU ``linear_fc1`` it writes in place, and a load reads a
checkpoint without those marks (written by an unfixed release) the way it was written, with a
warning. Why: without it, a job that resumes in the layout that wrote such a checkpoint, exact
before the fix, would read W and V rows from the wrong places once the fix is on.

The mark is a ShardedObject per written piece, ``<key>.swiglu_fsdp2_layout``, on the pieces' own
grid and with their replica index (no collective, one writer per piece). It is never asked for by
a load, so a release that does not know it (0.19 and later read these shards in place themselves)
ignores it. An unmarked checkpoint is read the release's way only where its chunks of the tensor
are exactly the pieces the release would write for this rank in this layout; any other layout of
an unmarked checkpoint is read in place.

The save and load hooks are the two preprocessing calls of ``dist_checkpointing.save`` / ``load``
as ``serialization`` binds them (``save_preprocess``, ``load_preprocess``): ``load`` itself may
carry another fix's layer. The load hook takes the checkpoint directory from the release's
``load`` frame that calls it (the only caller it acts for); the source diff passes it explicitly.
"""

from __future__ import annotations

import sys

from ....engine.layers import layer
from ....engine.patching import Patcher, below, mark, original
from .. import ID

SERIALIZATION = "megatron.core.dist_checkpointing.serialization"

# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/core/dist_checkpointing/serialization.py, above def load.

SWIGLU_FSDP2_LAYOUT = "swiglu_fsdp2_layout"


def _swiglu_fsdp2_factories(sharded_state_dict):
    """The factories that write FSDP2 shards of a SwiGLU linear_fc1 with their rows in place
    (``MLP.sharded_state_dict``'s ``_swiglu_dtensor_shard_build_fn``)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return [
        x
        for x in nested_values(sharded_state_dict)
        if isinstance(x, ShardedTensorFactory)
        and getattr(getattr(x.build_fn, "func", None), "__name__", "") == "_swiglu_dtensor_shard_build_fn"
    ]


def _swiglu_fsdp2_layout_marks(sharded_state_dict):
    """Before a save applies the factories: one ShardedObject per piece those factories write,
    saying that its rows are in place."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    marks = []
    for factory in _swiglu_fsdp2_factories(sharded_state_dict):
        for sh in factory.build_fn(factory.key, factory.data, factory.replica_id, None):
            axis = sh.prepend_axis_num
            offset = (*sh.global_offset[:axis], sh.global_offset[axis] // sh.local_shape[0])
            shape = tuple(sh.axis_fragmentations[: axis + 1])
            marks.append(
                ShardedObject(f"{sh.key}.{SWIGLU_FSDP2_LAYOUT}", "rows in place", shape, offset, sh.replica_id)
            )
    return marks


def _written_by_splitting_release(factory, metadata):
    """Is the checkpoint's tensor ``factory.key`` unmarked, with exactly the chunks the release
    writes for this rank's shard among its chunks?"""
    mark = f"{factory.key}.{SWIGLU_FSDP2_LAYOUT}/"
    if any(k.startswith(mark) for k in metadata.state_dict_metadata):
        return False
    stored = metadata.state_dict_metadata.get(factory.key)
    chunks = {(tuple(c.offsets), tuple(c.sizes)) for c in getattr(stored, "chunks", ())}
    release = factory.build_fn.keywords["release"](factory.key, factory.data, factory.replica_id, None)
    return bool(chunks) and all(
        (tuple(sh.global_offset), (1,) * sh.prepend_axis_num + tuple(sh.local_shape)) in chunks for sh in release
    )


def _read_swiglu_fsdp2_rows_as_written(sharded_state_dict, checkpoint_dir):
    """Before a load applies the factories: a checkpoint written by a release that split each FSDP2
    shard of a SwiGLU linear_fc1 in two is read back the same way (exact in the layout that wrote
    it, as that release read it), with a warning; anything else is read in place."""
    factories = _swiglu_fsdp2_factories(sharded_state_dict)
    if not factories or checkpoint_dir is None:
        return
    try:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(checkpoint_dir)).read_metadata()
    except Exception:  # not a torch_dist checkpoint: the load reports what it is
        return
    old = [f for f in factories if _written_by_splitting_release(f, metadata)]
    for factory in old:
        factory.build_fn = factory.build_fn.keywords["release"]
    if old:
        import warnings

        warnings.warn(
            f"{checkpoint_dir}: the SwiGLU linear_fc1 tensors {sorted({f.key for f in old})} of this FSDP2 "
            "checkpoint were written with W and V rows out of place (each data-parallel shard split in two); "
            "they are read back the same way, which is exact only in the layout that wrote them. Save the "
            "checkpoint again to write them in place."
        )


# -- end of replacement ---


def _release_load_code():
    return original(sys.modules[SERIALIZATION], "load").__code__


@layer(ID, SERIALIZATION, "save_preprocess")
def save_preprocess(below_us, sharded_state_dict, *args, **kwargs):
    """``serialization.save_preprocess``: the release's, plus the marks of in-place SwiGLU pieces."""
    marks = _swiglu_fsdp2_layout_marks(sharded_state_dict)  # before the factories are applied
    sharded_part, common = below_us(sharded_state_dict, *args, **kwargs)
    if marks:
        sharded_part[SWIGLU_FSDP2_LAYOUT] = marks
    return sharded_part, common


@mark(ID)
def load_preprocess(sharded_state_dict, *args, **kwargs):
    """``serialization.load_preprocess``: inside the release's ``load``, unmarked SwiGLU FSDP2 shards
    are first given back the release's build function (see the module docstring)."""
    caller = sys._getframe(1)
    if caller.f_code is _release_load_code():
        _read_swiglu_fsdp2_rows_as_written(sharded_state_dict, caller.f_locals.get("checkpoint_dir"))
    return below(ID, sys.modules[SERIALIZATION], "load_preprocess")(sharded_state_dict, *args, **kwargs)


def apply(patcher: Patcher) -> None:
    import importlib

    serialization = importlib.import_module(SERIALIZATION)
    patcher.replace(serialization, "save_preprocess", save_preprocess)
    patcher.replace(serialization, "load_preprocess", load_preprocess)
