"""fsdp-dtensor-pp-guard in Megatron-Bridge as upstream would carry it:
patches/fsdp-dtensor-pp-guard/megatron-bridge-<version>.patch.

``megatron/bridge/training/checkpointing.py`` gets ``_refuse_fsdp_dtensor_pipeline_change`` (and
its layout fields) above ``_load_checkpoint_from_path`` (its text from runtime/bridge.py's
replacement section, the code the monkeypatch runs), called in that function's fsdp_dtensor branch
right where it has read the checkpoint's ``run_config.yaml``: before the DCP metadata and any tensor
are read. The monkeypatch reaches the same point through the module's ``read_run_config`` binding;
tests/frameworks runs the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import PatchgenError, Replace, insert_before, replacement_section

PATH = "megatron/bridge/training/checkpointing.py"

# The fsdp_dtensor branch's read (the torch_dist branch's read is indented one level deeper and
# followed by ``else:``).
_READ = (
    "            run_config = read_run_config(run_config_filename)\n"
    "            ckpt_tp_pp = (\n"
)
_READ_GUARDED = (
    "            run_config = read_run_config(run_config_filename)\n"
    "            _refuse_fsdp_dtensor_pipeline_change(run_config, cfg.model, checkpoint_name)\n"
    "            ckpt_tp_pp = (\n"
)


def _helper() -> str:
    from ..runtime import bridge

    return replacement_section(bridge).strip("\n") + "\n\n\n"


def source_edits(version: str) -> list:
    """The edits for Megatron-Bridge ``version`` ("0.6.2" or "megatron-bridge-0.6.2")."""
    version = version.removeprefix("megatron-bridge-")
    if version != "0.6.2":
        raise PatchgenError(f"fsdp-dtensor-pp-guard has no Megatron-Bridge edits for {version} (written for 0.6.2)")
    return [
        insert_before(PATH, "def _load_checkpoint_from_path(\n", _helper()),
        Replace(PATH, _READ, _READ_GUARDED),
    ]
