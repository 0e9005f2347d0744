"""Write patches/expert-keys/<release>.patch from pristine Megatron-Core sources.

The diff replaces upstream's ``get_expert_index_from_key``, ``handle_experts_in_state_dict`` and
``expert_param_local_key`` in ``megatron/core/transformer/fsdp_dtensor_checkpoint.py`` by the code
between the "replacement" markers of mcore_ckpt_fixes/fixes/expert_keys.py, verbatim except for one
mechanical edit: ``sys.modules[MODULE]`` (the upstream module, seen from the fix) is read as
``sys.modules[__name__]``. From 0.17 (where the wheel ships ``megatron/training``) it also makes
``megatron/training/checkpointing.py`` import ``preprocess_state_dict_for_uneven_dtensor`` from the
patched module (the binding the monkeypatch replaces). tests/patches/test_source_patches.py checks
that the patched source satisfies the fix's probes and round-trips with the monkeypatch off.

    python tools/patchgen/expert_keys.py SRC_ROOT RELEASE > patches/expert-keys/RELEASE.patch
SRC_ROOT holds the unpacked wheel (SRC_ROOT/megatron/core/...).
"""

import os
import sys

from _diff import refuse_fix_names, replace_between, replacement_section, write_diff

TARGET = "megatron/core/transformer/fsdp_dtensor_checkpoint.py"
UPSTREAM_DEF, UPSTREAM_NEXT = "def get_expert_index_from_key(", "def handle_swiglu_in_state_dict("
# 0.17+: megatron.training's fsdp_dtensor save and load call the uneven-DTensor preprocessing by this
# name; the patched module's version (Megatron-FSDP's, then grouped experts made EP-global) takes its
# place, bound where the monkeypatch binds it (only there).
TRAINING = "megatron/training/checkpointing.py"
TRAINING_ANCHOR = "    HAVE_MEGATRON_FSDP = True\n"
TRAINING_IMPORT = (
    "    # Megatron-FSDP's uneven-DTensor preprocessing, then single grouped expert tensors described as\n"
    "    # their EP rank's block of the global tensor of all experts (fsdp_dtensor_checkpoint).\n"
    "    from megatron.core.transformer.fsdp_dtensor_checkpoint import preprocess_state_dict_for_uneven_dtensor\n"
)


def replacement_code() -> str:
    body = replacement_section("expert_keys.py")
    code = body.replace("sys.modules[MODULE]", "sys.modules[__name__]")
    refuse_fix_names(code, ("MODULE", "ID", "NAMES", "mark", "original"))
    header = (
        "# Expert keys get global expert indices under expert parallelism, biases as well as weights,\n"
        "# so EP ranks never write the same fsdp_dtensor key; num_experts=None with expert keys is an\n"
        "# error (it used to drop them), and a single grouped tensor (no index) keeps its key and, under\n"
        "# EP > 1, is described as its EP rank's rows of the global tensor of all experts.\n"
    )
    return header + code.rstrip("\n") + "\n\n\n"


def patch_text(text: str) -> str:
    return replace_between(text, UPSTREAM_DEF, UPSTREAM_NEXT, replacement_code(), TARGET)


def training_text(text: str) -> str:
    if text.count(TRAINING_ANCHOR) != 1:
        raise SystemExit(f"patchgen: {TRAINING}: anchor {TRAINING_ANCHOR!r} not found exactly once")
    return text.replace(TRAINING_ANCHOR, TRAINING_IMPORT + TRAINING_ANCHOR)


def main(src_root: str, release: str) -> None:
    write_diff(src_root, TARGET, patch_text)
    if os.path.exists(os.path.join(src_root, TRAINING)):  # the wheel ships megatron.training from 0.17
        write_diff(src_root, TRAINING, training_text)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
