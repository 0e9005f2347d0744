"""fused-adam-group-step as Megatron-Core would carry it: minimal edits of
``megatron/core/optimizer/distrib_optimizer.py``, the same change as runtime/core.py's layers
(tests/patches proves the diff by running the same round trip with the monkeypatch off):

* ``DistributedOptimizer.load_state_dict``: before anything reads the saved param groups, a group
  saved without a step takes the one step the other saved groups have (every release);
* ``DistributedOptimizer.state_dict`` on the FusedAdam path: every saved group on the one step of
  this rank's non-empty groups (releases before 0.14, which save the groups as they are; 0.14 added
  that alignment itself).
"""

from __future__ import annotations

from ....sourcediff import insert_before

TARGET = "megatron/core/optimizer/distrib_optimizer.py"

_HELPER = '''def _with_group_steps(state_dict):
    """``state_dict`` whose saved param groups without a step take the one step the others share.

    Apex's and Transformer Engine's FusedAdam keep one step per param group, made at its first step
    and advanced only where the group holds parameters; up to Megatron-Core 0.13 the groups of one
    rank were saved as they are, so a group empty there came without a step (NVIDIA/Megatron-LM#2016).
    Anything else (no group has a step, the steps differ) is returned as it is.
    """
    groups = state_dict.get("optimizer", {}).get("param_groups")
    if not isinstance(groups, list):
        return state_dict
    steps = [group["step"] for group in groups if "step" in group]
    if not steps or all("step" in group for group in groups) or any(s != steps[0] for s in steps):
        return state_dict
    filled = [group if "step" in group else {**group, "step": steps[0]} for group in groups]
    return {**state_dict, "optimizer": {**state_dict["optimizer"], "param_groups": filled}}


'''
_LOAD_ANCHOR = (
    "        if len(self.optimizer.state) == 0:\n"
    "            if isinstance(self.optimizer, HybridDeviceOptimizer):\n"
    "                self.optimizer.dummy_step()\n"
)
_LOAD = (
    "        # A FusedAdam param group saved without a step resumes on the others' (see _with_group_steps).\n"
    "        state_dict = _with_group_steps(state_dict)\n\n"
)
_SAVE_ANCHOR = (
    "        # Grad scaler state.\n"
    "        if self.grad_scaler:\n"
    "            state_dict['grad_scaler'] = self.grad_scaler.state_dict()\n"
)
_SAVE = (
    "        if HAVE_APEX_OR_TE and not isinstance(self.optimizer, HybridDeviceOptimizer):\n"
    "            # FusedAdam advances a group's step only where it has parameters: save every group\n"
    "            # on the one step of this rank's non-empty groups (this rank's groups may be the\n"
    "            # ones the checkpoint keeps for every rank).\n"
    "            steps = set(\n"
    '                g["step"] for g in self.optimizer.param_groups if g["params"] and "step" in g\n'
    "            )\n"
    "            if len(steps) == 1:\n"
    '                for param_group in state_dict["optimizer"]["param_groups"]:\n'
    '                    param_group["step"] = next(iter(steps))\n\n'
)


def source_edits(release: str) -> list:
    edits = [
        insert_before(TARGET, "class DistributedOptimizer(", _HELPER),
        insert_before(TARGET, _LOAD_ANCHOR, _LOAD),
    ]
    major, minor = (int(part) for part in release.split(".")[:2])
    if (major, minor) < (0, 14):
        edits.append(insert_before(TARGET, _SAVE_ANCHOR, _SAVE))
    return edits
