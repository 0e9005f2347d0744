"""Write patches/gdn-fsdp-split/<release>.patch from pristine Megatron-Core sources.

The diff replaces upstream's ``handle_gdn_in_state_dict`` (with its nested ``split_gdn_fused``) in
``megatron/core/transformer/fsdp_dtensor_checkpoint.py`` by the code between the "replacement"
markers of mcore_ckpt_fixes/fixes/gdn_fsdp_split.py, taken verbatim except for two mechanical edits:
``@mark(ID)`` is dropped and ``MODULE`` (the upstream module's name) is read as ``__name__``. The
monkeypatch and the diff are the same code by construction; tests/patches/test_source_patches.py
checks that the patched source satisfies the fix's probe and round-trips with the monkeypatch off.

    python tools/patchgen/gdn_fsdp_split.py SRC_ROOT RELEASE > patches/gdn-fsdp-split/RELEASE.patch
SRC_ROOT holds the unpacked wheel (SRC_ROOT/megatron/core/...).
"""

import sys

from _diff import refuse_fix_names, replace_between, replacement_section, write_diff

TARGET = "megatron/core/transformer/fsdp_dtensor_checkpoint.py"
UPSTREAM_DEF, UPSTREAM_NEXT = "def handle_gdn_in_state_dict(", "def handle_fp8_extra_state_case("


def replacement_code() -> str:
    body = replacement_section("gdn_fsdp_split.py")
    lines = [ln for ln in body.splitlines(keepends=True) if ln.strip() != "@mark(ID)"]
    code = "".join(lines).replace("sys.modules[MODULE]", "sys.modules[__name__]")
    code = code.replace("logging.getLogger(MODULE)", "logging.getLogger(__name__)")
    refuse_fix_names(code, ("MODULE", "ID", "NAME", "mark"))
    header = (
        "# GDN fused projections (in_proj q/k/v/z/b/a, conv1d q/k/v) are split without any collective:\n"
        "# every rank derives its pieces, their TP-global shapes and chunk offsets from metadata that is\n"
        "# identical on all ranks plus its own mesh coordinates, whatever layout it holds (TP-global or\n"
        "# TP-local DTensor, plain local Tensor). No per-rank branch, so ranks cannot diverge and hang.\n"
    )
    return header + code.rstrip("\n") + "\n\n\n"


def patch_text(text: str) -> str:
    return replace_between(text, UPSTREAM_DEF, UPSTREAM_NEXT, replacement_code(), TARGET)


def main(src_root: str, release: str) -> None:
    write_diff(src_root, TARGET, patch_text)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
