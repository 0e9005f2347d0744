"""torch-adam-step as Megatron-Core would carry it: three minimal edits of the release's own lines in
``megatron/core/optimizer/distrib_optimizer.py``, the same change as runtime/core.py's wrappers
(which hand each call to the release's method; tests/patches proves the diff by running the same
round trips with the monkeypatch off):

* ``DistributedOptimizer.state_dict``, torch's Adam branch: no per-parameter step yet (a freshly
  built optimizer) is step 0 instead of a failed ``assert len(steps) == 1``;
* ``_set_main_param_and_optimizer_states``: the per-parameter step is not among the tensors copied
  from the loaded state (``load_state_dict`` has set it from the checkpoint's param groups), in
  torch Adam's branch and in HybridDeviceOptimizer's;
* ``load_state_dict``, torch's Adam branch: each parameter gets its own step tensor, and the step
  the param groups carried into the parameters' state is not left in torch's param groups.
"""

from __future__ import annotations

from ....sourcediff import Replace

TARGET = "megatron/core/optimizer/distrib_optimizer.py"

_STATE_DICT_OLD = (
    '            steps = list(set([s["step"].item() for s in inner_state_dict["state"].values()]))\n'
    "            assert len(steps) == 1\n"
    "            step = steps[0]\n"
)
_STATE_DICT_NEW = (
    '            steps = list(set([s["step"].item() for s in inner_state_dict["state"].values()]))\n'
    "            # A freshly built optimizer has no per-parameter state yet: it is at step 0.\n"
    '            assert len(steps) <= 1, f"steps: {steps}"\n'
    "            step = steps[0] if steps else 0.0\n"
)
_WHY_NOT_STEP = (
    "# The step was set from the param groups by load_state_dict (the checkpoint's): the\n"
    "{indent}# loaded per-parameter state has none, or the one from before the load.\n"
)
# 0.17.0+: only tensors are copied.
_SET_STATES_OLD = "                if isinstance(v, torch.Tensor):\n                    dst_tensors[k] = v\n"
_SET_STATES_NEW = (
    "                " + _WHY_NOT_STEP.replace("{indent}", "                ") + "                "
    'if isinstance(v, torch.Tensor) and k != "step":\n'
    "                    dst_tensors[k] = v\n"
)
# 0.16.x: the whole state.
_SET_STATES_OLD_16 = '            dst_tensors = {"param": main_param, **optim_state}\n'
_SET_STATES_NEW_16 = (
    "            " + _WHY_NOT_STEP.replace("{indent}", "            ") + "            "
    'dst_tensors = {"param": main_param, **{k: v for k, v in optim_state.items() if k != "step"}}\n'
)
_LOAD_OLD = '                s["step"] = step\n'
_LOAD_NEW = (
    "                # Each its own tensor: torch's Adam increments the step in place.\n"
    '                s["step"] = step.clone()\n'
)
_LOADED_OLD = (
    "        self.optimizer.load_state_dict(\n"
    '            {"state": state_dict_state, "param_groups": state_dict_param_groups}\n'
    "        )\n"
)
_LOADED_NEW = _LOADED_OLD + (
    "        if not HAVE_APEX_OR_TE:\n"
    "            # The param groups only carried the step into each parameter's state: torch's Adam\n"
    "            # keeps none in its groups, and one left there would stay at the loaded value.\n"
    "            for param_group in self.optimizer.param_groups:\n"
    '                param_group.pop("step", None)\n'
)


# HybridDeviceOptimizer (CPU offload), precision-aware branch: its CPU optimizers are torch's AdamW.
_HYBRID_OLD = '                if isinstance(self.optimizer, HybridDeviceOptimizer):\n                    if k == "param":\n'
_HYBRID_NEW = (
    "                if isinstance(self.optimizer, HybridDeviceOptimizer):\n"
    "                    # Its CPU optimizers are torch's AdamW, whose step load_state_dict has set.\n"
    '                    if k == "step":\n'
    "                        continue\n"
    '                    if k == "param":\n'
)


def source_edits(release: str) -> list:
    sixteen = release.startswith("0.16.") or release.startswith("0.15.")
    set_states = (
        Replace(TARGET, _SET_STATES_OLD_16, _SET_STATES_NEW_16)
        if sixteen
        else Replace(TARGET, _SET_STATES_OLD, _SET_STATES_NEW)
    )
    return [
        Replace(TARGET, _STATE_DICT_OLD, _STATE_DICT_NEW),
        set_states,
        Replace(TARGET, _HYBRID_OLD, _HYBRID_NEW),
        Replace(TARGET, _LOAD_OLD, _LOAD_NEW),
        Replace(TARGET, _LOADED_OLD, _LOADED_NEW),
    ]
