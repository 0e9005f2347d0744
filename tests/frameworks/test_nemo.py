"""NeMo's fsdp_dtensor path.

NeMo 2's ``MegatronStrategy._get_fsdp_dtensor_state_dict`` (nemo-toolkit <= 2.7,
``nemo.lightning.pytorch.strategies.megatron_strategy``) preprocesses fsdp_dtensor checkpoints
without ``handle_experts_in_state_dict``: under EP its expert keys keep local indices. The current
release, nemo-toolkit 3.0.0, has no ``nemo.lightning`` at all. expert-keys declares the module as a
target gated by nemo-toolkit's version: with 3.0.0 installed (tools/frameworks/nemo-toolkit.txt,
the wheel alone) ``status`` must say not-applicable and why; with NeMo 2's strategy present the
target reports the gap as failed (a MegatronPatchWarning), never applied (checked on a module that
has the strategy's method as NeMo 2.7.3 writes it: calling the preprocessing, not the expert
handling, since NeMo 2 cannot be imported here without Lightning, Megatron's CUDA-only parts and
more).
"""

from __future__ import annotations

import json
import types

from framework_import import import_framework

from mcore_ckpt_fixes.fixes.expert_keys import NEMO


def test_status_says_not_applicable_with_nemo_3(tmp_path):
    import importlib.metadata

    import_framework("nemo-toolkit", "nemo")
    assert importlib.metadata.version("nemo-toolkit") == "3.0.0"
    from conftest import run_cli

    proc = run_cli(["status", "--json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = {r["id"]: r for r in json.loads(proc.stdout)}["expert-keys"]
    target = row["targets"][NEMO]
    assert target["state"] == "not-applicable" and target["package"] == "nemo-toolkit", target
    assert target["reason"] == f"nemo-toolkit 3.0.0 does not ship {NEMO}", target


def test_nemo_2_strategy_is_reported_as_a_gap():
    from mcore_ckpt_fixes.fixes.expert_keys.runtime.nemo import apply_nemo, probe_nemo

    def _get_fsdp_dtensor_state_dict(self, raw_state_dict, model_key="model", optimizer_key="optimizer_states"):
        # the names NeMo 2.7.3's method refers to (handle_fp8..., handle_swiglu..., preprocess...)
        state_dict = raw_state_dict.copy()
        handle_fp8_extra_state_case(state_dict[model_key])  # noqa: F821
        handle_swiglu_in_state_dict(self.model, state_dict[model_key], {})  # noqa: F821
        preprocess_state_dict_for_uneven_dtensor(state_dict)  # noqa: F821
        return state_dict

    module = types.ModuleType(NEMO)
    module.MegatronStrategy = type(
        "MegatronStrategy", (), {"_get_fsdp_dtensor_state_dict": _get_fsdp_dtensor_state_dict}
    )
    verdict, why = probe_nemo(module)
    assert verdict is True and "without handle_experts_in_state_dict" in why
    try:
        apply_nemo(module, None)
    except NotImplementedError as exc:
        assert "does not cover" in str(exc)
    else:
        raise AssertionError("apply_nemo must refuse: the gap is reported, not patched")
    assert probe_nemo(types.ModuleType(NEMO)) == (
        None,
        f"{NEMO} has no MegatronStrategy._get_fsdp_dtensor_state_dict (no fsdp_dtensor path)",
    )
