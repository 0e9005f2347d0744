"""hybrid-optimizer-dp-zero-load as Megatron-Core would carry it: in
``megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py`` ``HybridDeviceOptimizer.dummy_step``
gives its parameters back the values they had before the step; in
``megatron/core/optimizer/distrib_optimizer.py`` ``load_parameter_state_from_dp_zero`` (and its
legacy-format branch) ends with the hybrid optimizer's ``_sync_hdo_state_to_sub_optimizers``, as
runtime/core.py's layers do. tests/patches runs the same round trips with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace

HYBRID = "megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py"
DISTRIB = "megatron/core/optimizer/distrib_optimizer.py"

_DUMMY_OLD = "                param.grad = torch.randn_like(param)\n        self.step()\n        self.zero_grad()\n"
_DUMMY_NEW = (
    "                param.grad = torch.randn_like(param)\n"
    "        # The step only creates the state: the parameters it wrote (through the copy-back hooks)\n"
    "        # get back their values, which a load may have just set.\n"
    "        params = [param for group in self.param_groups for param in group['params']]\n"
    "        kept = [param.detach().clone() for param in params]\n"
    "        self.step()\n"
    "        self.zero_grad()\n"
    "        with torch.no_grad():\n"
    "            for param, value in zip(params, kept):\n"
    "                param.copy_(value)\n"
)

_SYNC = (
    "{indent}if isinstance(self.optimizer, HybridDeviceOptimizer):\n"
    "{indent}    # As the other loads: the sub-optimizers step the loaded master params and moments.\n"
    "{indent}    self.optimizer._sync_hdo_state_to_sub_optimizers()\n"
)

_END_OLD = (
    "                for model_param, tensors in recv_tensors.items():\n"
    "                    self._set_main_param_and_optimizer_states(model_param, tensors)\n\n"
)
_END_NEW = (
    "                for model_param, tensors in recv_tensors.items():\n"
    "                    self._set_main_param_and_optimizer_states(model_param, tensors)\n"
    + _SYNC.format(indent="        ")
    + "\n"
)

_LEGACY_OLD = "            return self.load_parameter_state_from_dp_zero_legacy(state_dict)\n"
_LEGACY_NEW = (
    "            out = self.load_parameter_state_from_dp_zero_legacy(state_dict)\n"
    + _SYNC.format(indent="            ")
    + "            return out\n"
)


def source_edits(release: str) -> list:
    return [
        Replace(HYBRID, _DUMMY_OLD, _DUMMY_NEW),
        Replace(DISTRIB, _END_OLD, _END_NEW),
        Replace(DISTRIB, _LEGACY_OLD, _LEGACY_NEW),
    ]
