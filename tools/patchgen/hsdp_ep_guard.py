"""Write patches/hsdp-ep-guard/<release>.patch (0.16.x) from pristine Megatron-Core sources.

The diff puts the guard of mcore_ckpt_fixes/fixes/hsdp_ep_guard.py at the top of
``FullyShardedDataParallel._init_dist_index`` in
``megatron/core/distributed/fsdp/mcore_fsdp_adapter.py``: with HSDP
(``num_distributed_optimizer_instances > 1``) and an expert-parallel size > 1 it raises the same
``ValueError`` line as the monkeypatch (the text comes from ``hsdp_ep_guard.refusal``).
tests/patches/test_source_patches.py checks that the patched source satisfies the fix's probe and
that its scenario is exact with the monkeypatch off.

    python tools/patchgen/hsdp_ep_guard.py SRC_ROOT RELEASE > patches/hsdp-ep-guard/RELEASE.patch
"""

import os
import sys

from _diff import write_diff

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from mcore_ckpt_fixes.fixes.hsdp_ep_guard import refusal  # noqa: E402  (imports no torch/megatron)

TARGET = "megatron/core/distributed/fsdp/mcore_fsdp_adapter.py"
ANCHOR = "        enable_hsdp = self.ddp_config.num_distributed_optimizer_instances > 1\n"


def guard_code() -> str:
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


def patch_text(text: str) -> str:
    if text.count(ANCHOR) != 1:
        raise SystemExit(f"patchgen: {TARGET}: anchor not found exactly once: {ANCHOR!r}")
    return text.replace(ANCHOR, ANCHOR + guard_code())


def main(src_root: str, release: str) -> None:
    write_diff(src_root, TARGET, patch_text)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
