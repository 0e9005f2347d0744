"""gdn-fsdp-split's source edit of ``megatron/core/transformer/fsdp_dtensor_checkpoint.py``.

The runtime replaces the whole function, so the diff takes its text from the runtime module:
``runtime/split.py``'s section between the "replacement" markers (``sourcediff.replacement_section``),
with the upstream module's names (``sys.modules[MODULE].X`` there) read as the function's own
globals. Nothing here restates it.

    python tools/patchgen gdn-fsdp-split SRC_ROOT RELEASE > patches/gdn-fsdp-split/RELEASE.patch

SRC_ROOT holds the unpacked wheel (SRC_ROOT/megatron/core/...).
"""

from __future__ import annotations

TARGET = "megatron/core/transformer/fsdp_dtensor_checkpoint.py"
UPSTREAM_DEF, UPSTREAM_NEXT = "def handle_gdn_in_state_dict(", "def handle_fp8_extra_state_case("


def _own_globals(code: str) -> str:
    """The runtime reads the upstream module's names through ``sys.modules[MODULE]`` (it lives in
    another module); in the upstream file they are the function's own globals, read by name (which
    is also what the probe's copy of the module's globals stands in for)."""
    import re

    code = re.sub(r"\n[ ]*upstream = sys\.modules\[MODULE\]\n", "\n", code)
    code = re.sub(r"\bupstream\.(?=[A-Za-z_])", "", code)
    code = code.replace("sys.modules[MODULE].", "")
    if "sys." not in code.replace("import sys", ""):
        code = re.sub(r"\n[ ]*import sys\n\n?", "\n", code)
    return code


def replacement_code() -> str:
    from ....sourcediff import refuse_names, replacement_section
    from ..runtime import split

    code = _own_globals(replacement_section(split))
    code = code.replace("logging.getLogger(MODULE)", "logging.getLogger(__name__)")
    refuse_names(code, ("MODULE", "ID", "NAME", "mark"))
    header = (
        "# GDN fused projections (in_proj q/k/v/z/b/a, conv1d q/k/v) are split without any collective:\n"
        "# every rank derives its pieces, their TP-global shapes and chunk offsets from metadata that is\n"
        "# identical on all ranks plus its own mesh coordinates, whatever layout it holds (TP-global or\n"
        "# TP-local DTensor, plain local Tensor). No per-rank branch, so ranks cannot diverge and hang.\n"
    )
    return header + code.rstrip("\n") + "\n\n\n"


def source_edits(release: str) -> list:
    """The one edit, the same on every affected release line (0.18.x, 0.19.x): upstream's function,
    up to the next top-level one, becomes the replacement."""
    from ....sourcediff import ReplaceBetween

    return [ReplaceBetween(TARGET, UPSTREAM_DEF, UPSTREAM_NEXT, replacement_code())]
