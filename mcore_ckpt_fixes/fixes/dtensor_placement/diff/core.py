"""dtensor-placement as Megatron-Core would carry it: the code of patches/dtensor-placement/<release>.patch
and its source edits, per release.

The edits mirror the monkeypatch (``runtime/core.py``) in effect:

* megatron/core/utils.py (0.12-0.19; on 0.12-0.15 the helpers read parallel_state, so the TP rank
  does too): a DTensor the release's helper treats as one (every DTensor up to 0.18;
  on 0.19 those tagged ``is_torch_fsdp2_param``) is described from its own mesh and placements by
  ``_dtensor_shard_for_checkpoint`` before the release's dense-DP branch is reached; an
  all-Replicate DTensor (or one on a size-1 mesh) continues on the plain path with its local tensor
  and the replica index its own mesh gives, not the dense DP group's;
* megatron/core/transformer/moe/experts.py: SequentialMLP keeps the replica index of those shards
  (tagged ``is_torch_fsdp2_param``) instead of overwriting it with the expert-DP rank.

``_dtensor_shard_for_checkpoint`` is the runtime's own helper, taken verbatim from ``runtime/shard.py``
(``sourcediff.replacement_section``): the monkeypatch calls the same function for a sharded DTensor.
tests/patches/test_source_patches.py checks that the patched source satisfies every probe of the
fix and round-trips with the monkeypatch off.

    python tools/patchgen dtensor-placement SRC_ROOT RELEASE > patches/dtensor-placement/RELEASE.patch

SRC_ROOT holds the unpacked wheel (SRC_ROOT/megatron/core/...). Imports no torch or megatron.
"""

from __future__ import annotations

from ....sourcediff import PatchgenError, Transform, insert_after, replacement_section

UTILS = "megatron/core/utils.py"
EXPERTS = "megatron/core/transformer/moe/experts.py"
TAG_TEST = 'hasattr(tensor, "is_torch_fsdp2_param")'


ANCHOR = "    dp_replica_id = get_pg_rank(dp_cp_group)\n"
# 0.12-0.15: the helpers take no groups and read parallel_state.
LEGACY_ANCHOR = "    dp_replica_id = parallel_state.get_data_parallel_rank(with_context_parallel=True)\n"


def _branch(tag, call):
    """The DTensor branch each helper gets right after its dense-DP replica id is computed."""
    cond = "HAVE_DTENSOR and isinstance(tensor, DTensor)" + (f" and {TAG_TEST}" if tag else "")
    return (
        f"\n    if {cond}:\n"
        "        # Offsets, global shape and replica id from the DTensor's own mesh and placements.\n"
        f"        sh_ten, mesh_replica_id = _dtensor_shard_for_checkpoint({call})\n"
        "        if sh_ten is not None:\n"
        "            return sh_ten\n"
        "        # Not sharded: the plain path, nothing gathered; a replica only across its own mesh.\n"
        "        tensor, dp_replica_id = tensor._local_tensor, mesh_replica_id\n"
    )


def _insert_after(text, func, anchor, insert):
    """``insert`` after ``anchor``, searched inside function ``func`` only (both helpers share it)."""
    start = text.index(f"\ndef {func}(")
    at = text.index(anchor, start) + len(anchor)
    end = text.find("\ndef ", start + 1)
    if end != -1 and at > end:
        raise PatchgenError(f"anchor not found in {func}: {anchor!r}")
    return text[:at] + insert + text[at:]


def patch_utils(text):
    """megatron/core/utils.py: the DTensor branch in both helpers, and the helper they call."""
    tag = TAG_TEST in text  # 0.19 enters its DTensor branch only for tagged tensors
    legacy = ANCHOR not in text
    anchor = LEGACY_ANCHOR if legacy else ANCHOR
    tp_rank = "parallel_state.get_tensor_model_parallel_rank()" if legacy else "get_pg_rank(tp_group)"
    text = _insert_after(
        text,
        "make_tp_sharded_tensor_for_checkpoint",
        anchor,
        _branch(
            tag,
            "\n            tensor, key, prepend_offsets, tp_axis, tp_rank, tp_size, 0, replica_id, kwargs\n        ",
        ),
    )
    text = _insert_after(
        text,
        "make_sharded_tensor_for_checkpoint",
        anchor,
        _branch(
            tag,
            "\n            tensor,\n            key,\n            prepend_offsets,\n            None,\n            0,\n"
            f"            1,\n            {tp_rank},\n            replica_id,\n            kwargs,\n        ",
        ),
    )
    at = text.index("\ndef make_tp_sharded_tensor_for_checkpoint(") + 1
    return text[:at] + helper_code() + text[at:]


def helper_code() -> str:
    """The helper the diff adds to megatron/core/utils.py, before make_tp_sharded_tensor_for_checkpoint:
    the runtime's own (``runtime/shard.py``), verbatim."""
    from ..runtime import shard

    return replacement_section(shard)


# SequentialMLP.sharded_state_dict's loop over its experts' ShardedTensors (every release).
EXPERTS_ANCHOR = "            for k, sh_ten in expert_state_dict.items():\n"
EXPERTS_SKIP = (
    '                if getattr(sh_ten, "is_torch_fsdp2_param", False):\n'
    "                    continue  # described from its DTensor's mesh, replica index included\n"
)


def source_edits(release: str) -> list:
    """The same edits for every release: :func:`patch_utils` reads from the file which helper
    signatures (groups or parallel_state) and DTensor test (tagged or not) the release has."""
    return [Transform(UTILS, patch_utils), insert_after(EXPERTS, EXPERTS_ANCHOR, EXPERTS_SKIP)]
