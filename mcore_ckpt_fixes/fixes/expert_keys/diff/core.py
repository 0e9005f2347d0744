"""expert-keys' source edits of Megatron-Core's files (patches/expert-keys/<release>.patch).

The runtime replaces the key functions whole, so the diff takes their text from the runtime module:
``runtime/keys.py``'s section between the "replacement" markers (``sourcediff.replacement_section``),
with ``sys.modules[MODULE]`` read as ``sys.modules[__name__]``. From 0.17 (where the wheel ships
``megatron/training``) it also makes ``megatron/training/checkpointing.py`` import
``preprocess_state_dict_for_uneven_dtensor`` from the patched module (the binding the monkeypatch
replaces): the minimal edit there. tests/patches/test_source_patches.py checks that the patched source
satisfies the fix's probes and round-trips with the monkeypatch off.

    python tools/patchgen expert-keys SRC_ROOT RELEASE > patches/expert-keys/RELEASE.patch

SRC_ROOT holds the unpacked wheel (SRC_ROOT/megatron/core/...).
"""

from __future__ import annotations

TARGET = "megatron/core/transformer/fsdp_dtensor_checkpoint.py"
UPSTREAM_DEF, UPSTREAM_NEXT = "def get_expert_index_from_key(", "def handle_swiglu_in_state_dict("
# 0.17+: megatron.training's fsdp_dtensor save and load call the uneven-DTensor preprocessing by this
# name; the patched module's version (Megatron-FSDP's, then grouped experts made EP-global) takes its
# place, bound where the monkeypatch binds it (only there).
TRAINING_FILE = "megatron/training/checkpointing.py"
TRAINING_ANCHOR = "    HAVE_MEGATRON_FSDP = True\n"
TRAINING_IMPORT = (
    "    # Megatron-FSDP's uneven-DTensor preprocessing, then single grouped expert tensors described as\n"
    "    # their EP rank's block of the global tensor of all experts (fsdp_dtensor_checkpoint).\n"
    "    from megatron.core.transformer.fsdp_dtensor_checkpoint import preprocess_state_dict_for_uneven_dtensor\n"
)


def replacement_code() -> str:
    from ....sourcediff import refuse_names, replacement_section
    from ..runtime import keys

    # The upstream module's parallel_state, read through sys.modules[MODULE] by the runtime (which
    # lives in another module), is the function's own global there.
    code = replacement_section(keys).replace("    import sys\n\n", "").replace("sys.modules[MODULE].parallel_state", "parallel_state")
    code = code.replace("sys.modules[MODULE]", "sys.modules[__name__]")
    refuse_names(code, ("MODULE", "ID", "NAMES", "mark", "original"))
    header = (
        "# Expert keys get global expert indices under expert parallelism, biases as well as weights,\n"
        "# so EP ranks never write the same fsdp_dtensor key; num_experts=None with expert keys is an\n"
        "# error (it used to drop them), and a single grouped tensor (no index) keeps its key and, under\n"
        "# EP > 1, is described as its EP rank's rows of the global tensor of all experts.\n"
    )
    return header + code.rstrip("\n") + "\n\n\n"


def source_edits(release: str) -> list:
    """The same on every affected release line: upstream's key functions, up to the next top-level
    one, become the replacement; where the release ships ``megatron/training`` (0.17+ wheels) its
    checkpointing imports the patched preprocessing."""
    from ....sourcediff import ReplaceBetween, insert_before

    return [
        ReplaceBetween(TARGET, UPSTREAM_DEF, UPSTREAM_NEXT, replacement_code()),
        insert_before(TRAINING_FILE, TRAINING_ANCHOR, TRAINING_IMPORT, optional=True),
    ]
