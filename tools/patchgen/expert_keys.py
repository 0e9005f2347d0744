"""Write patches/expert-keys/<release>.patch from pristine Megatron-Core sources.

The diff replaces upstream's ``get_expert_index_from_key``, ``handle_experts_in_state_dict`` and
``expert_param_local_key`` in ``megatron/core/transformer/fsdp_dtensor_checkpoint.py`` by the code
between the "replacement" markers of mcore_ckpt_fixes/fixes/expert_keys.py, verbatim except for one
mechanical edit: ``sys.modules[MODULE]`` (the upstream module, seen from the fix) is read as
``sys.modules[__name__]``. tests/patches/test_source_patches.py checks that the patched source
satisfies the fix's probe and round-trips with the monkeypatch off.

    python tools/patchgen/expert_keys.py SRC_ROOT RELEASE > patches/expert-keys/RELEASE.patch
SRC_ROOT holds the unpacked wheel (SRC_ROOT/megatron/core/...).
"""

import os
import re
import sys

from _diff import replace_between, write_diff

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIX_MODULE = os.path.join(ROOT, "mcore_ckpt_fixes", "fixes", "expert_keys.py")
TARGET = "megatron/core/transformer/fsdp_dtensor_checkpoint.py"
BEGIN, END = "# -- replacement ---", "# -- end of replacement ---"
UPSTREAM_DEF, UPSTREAM_NEXT = "def get_expert_index_from_key(", "def handle_swiglu_in_state_dict("


def replacement_code() -> str:
    with open(FIX_MODULE, encoding="utf-8") as f:
        text = f.read()
    start, stop = text.index(BEGIN), text.index(END)
    body = text[start:stop]
    body = body[body.index("\n\n") + 2 :]  # drop the marker comment block: it speaks of the fix module
    code = body.replace("sys.modules[MODULE]", "sys.modules[__name__]")
    for name in ("MODULE", "ID", "NAMES", "mark", "original"):
        if re.search(rf"\b{name}\b", code):
            raise SystemExit(f"patchgen: the replacement still refers to the fix module's {name!r}")
    header = (
        "# Expert keys get global expert indices under expert parallelism, biases as well as weights,\n"
        "# so EP ranks never write the same fsdp_dtensor key; num_experts=None with expert keys is an\n"
        "# error (it used to drop them), and a single grouped tensor (no index) is kept at EP = 1.\n"
    )
    return header + code.rstrip("\n") + "\n\n\n"


def patch_text(text: str) -> str:
    return replace_between(text, UPSTREAM_DEF, UPSTREAM_NEXT, replacement_code(), TARGET)


def main(src_root: str, release: str) -> None:
    write_diff(src_root, TARGET, patch_text)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
