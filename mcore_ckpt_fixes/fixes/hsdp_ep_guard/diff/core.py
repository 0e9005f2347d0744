"""hsdp-ep-guard as Megatron-Core 0.16.x would carry it: the source edit of
patches/hsdp-ep-guard/<release>.patch (0.16.x).

The diff puts the guard at the top of ``FullyShardedDataParallel._init_dist_index`` in
``megatron/core/distributed/fsdp/mcore_fsdp_adapter.py``: with HSDP
(``num_distributed_optimizer_instances > 1``) and an expert-parallel size > 1 it raises the same
``ValueError`` line as the monkeypatch (both take the text from ``runtime/core.py``'s :func:`refusal`).
tests/patches/test_source_patches.py checks that the patched source satisfies the fix's probe and
that its scenario is exact with the monkeypatch off.

    python tools/patchgen hsdp-ep-guard SRC_ROOT RELEASE > patches/hsdp-ep-guard/RELEASE.patch

Imports no torch or megatron (nor does the runtime module it takes the message from).
"""

from __future__ import annotations

from ....sourcediff import insert_after
from ..runtime.core import refusal

TARGET = "megatron/core/distributed/fsdp/mcore_fsdp_adapter.py"
ANCHOR = "        enable_hsdp = self.ddp_config.num_distributed_optimizer_instances > 1\n"


def guard_code() -> str:
    """The guard as the release's own code: :func:`refusal`'s text as an f-string of the release's
    variables, so the diff raises exactly the monkeypatch's line."""
    text = refusal("{self.ddp_config.num_distributed_optimizer_instances}", "{ep_size}")
    words, lines, line = text.split(" "), [], ""
    for w in words:  # wrap the f-string at ~80 columns, as upstream formats its messages
        if line and len(line) + len(w) > 76:
            lines.append(line)
            line = ""
        line += w + " "
    lines.append(line.rstrip(" "))
    message = "".join(f"                    f{ln!r}\n" for ln in lines)
    return (
        "        if enable_hsdp:\n"
        "            # This release builds no expert mesh for HSDP: experts would be sharded on the\n"
        "            # dense data-parallel mesh. Refuse EP > 1 with HSDP instead (0.17 supports it).\n"
        "            if pg_collection is not None:\n"
        "                ep_group = getattr(pg_collection, 'ep', None)\n"
        "                ep_size = ep_group.size() if ep_group is not None else 1\n"
        "            else:\n"
        "                ep_size = max(parallel_state.get_expert_model_parallel_world_size(), 1)\n"
        "            if ep_size > 1:\n"
        "                raise ValueError(\n"
        f"{message}"
        "                )\n"
    )


def source_edits(release: str) -> list:
    """The guard right after ``enable_hsdp`` is computed (the same in every 0.16.x release)."""
    return [insert_after(TARGET, ANCHOR, guard_code())]
