"""dist-optim-state as Megatron-Core would carry it: minimal edits of the release's own lines in
``megatron/core/optimizer/distrib_optimizer.py``, the same change as runtime/core.py's wrappers
(which hand each call to the release's method; tests/patches proves the diff by running the same
round trips with the monkeypatch off):

* ``sharded_state_dict`` without ``is_loading`` on an optimizer that has no state yet describes the
  state Adam starts from (``init_state_fn``'s zero moments, step 0 on torch's Adam) and leaves the
  optimizer without state (a new method, ``_has_no_optimizer_state``, says when);
* ``load_state_dict`` of a checkpoint whose parameter state is that of an Adam that had not
  stepped (no step counted, zero moments: what the request above saves) leaves the optimizer
  without state, as the run that saved it was (a new method, ``_loaded_before_first_step``);
* the format a call that names none gets is ``dp_reshardable``;
* ``load_parameter_state_from_dp_reshardable`` is ``@torch.no_grad()``, as its siblings are.

Edits for the release lines whose ``sharded_state_dict`` takes ``metadata`` (0.13.0 on).
"""

from __future__ import annotations

from ....sourcediff import Replace, insert_after, insert_before

TARGET = "megatron/core/optimizer/distrib_optimizer.py"

_HAS_NO_STATE = '''    def _has_no_optimizer_state(self) -> bool:
        """No step taken and nothing loaded yet: no parameter has optimizer state (which
        init_state_fn creates as plain tensors in self.optimizer.state)."""
        if (
            self.init_state_fn is None
            or self.ddp_config.use_megatron_fsdp
            or self.config.use_precision_aware_optimizer
            or isinstance(self.optimizer, HybridDeviceOptimizer)
        ):
            return False
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return bool(params) and not any(self.optimizer.state.get(p) for p in params)

'''
_DESCRIBE_ANCHOR = "        state_dict = self.state_dict()\n"
_DESCRIBE_FRESH = """        if not is_loading and self._has_no_optimizer_state():
            # Described as it is, an optimizer that has not stepped has no moments: a load request
            # would restore none, a save would write none. Describe the state Adam starts from and
            # leave the optimizer without state, so that load_state_dict allocates its own.
            self.init_state_fn(self.optimizer, self.config)
            if not HAVE_APEX_OR_TE:  # torch's Adam: its state_dict reads a per-parameter step
                for group in self.optimizer.param_groups:
                    for param in group["params"]:
                        self.optimizer.state[param].setdefault("step", torch.tensor(0.0))
            try:
                return self.sharded_state_dict(
                    model_sharded_state_dict,
                    is_loading,
                    metadata={**(metadata or {}), 'distrib_optim_sharding_type': sharding_type},
                )
            finally:
                self.optimizer.state.clear()

"""
_DEFAULT_OLD = "'distrib_optim_sharding_type', 'fully_sharded_model_space'"
_DEFAULT_NEW = (
    "# fully_sharded_model_space (flattened_range) can no longer be saved: the default is\n"
    "{indent}# what Megatron-LM's save_checkpoint asks for.\n"
    "{indent}'distrib_optim_sharding_type', 'dp_reshardable'"
)
_LOADED_BEFORE_FIRST_STEP = '''    def _loaded_before_first_step(self) -> bool:
        """The optimizer holds what a checkpoint of an Adam that had not stepped restores: no
        step counted (FusedAdam counts in its param groups, torch's Adam per parameter) and every
        moment zero, the state sharded_state_dict describes for an optimizer without state."""
        if (
            self.init_state_fn is None
            or self.ddp_config.use_megatron_fsdp
            or self.config.use_precision_aware_optimizer
            or isinstance(self.optimizer, HybridDeviceOptimizer)
            or not isinstance(self.optimizer, (Adam, torch.optim.Adam, torch.optim.AdamW))
            or any(group.get("step") for group in self.optimizer.param_groups)
        ):
            return False
        states = [s for s in self.optimizer.state.values() if s]
        for s in states:
            if not {"exp_avg", "exp_avg_sq", "step"}.issuperset(s):
                return False
            if s.get("step") is not None and float(s["step"]) != 0.0:
                return False
            if any(s[k].any() for k in ("exp_avg", "exp_avg_sq") if k in s):
                return False
        return bool(states)

'''
_LOAD_END = (
    "                self.load_parameter_state_from_fs_model_space(param_state)\n"
    "            else:\n"
    "                raise NotImplementedError(f'Unknown sharding_type: {sharding_type}')\n"
)
_LOAD_FRESH = """            if self._loaded_before_first_step():
                # Saved before the optimizer's first step: the run that saved it had no optimizer
                # state. Leave none, as that run has; Adam creates the same zeros at its first step.
                self.optimizer.state.clear()
"""
_LOAD_DP = "    def load_parameter_state_from_dp_reshardable(self, state_dict):\n"


def source_edits(release: str) -> list:
    return [
        insert_before(TARGET, "    def sharded_state_dict(\n", _HAS_NO_STATE),
        Replace(TARGET, _DEFAULT_OLD, _DEFAULT_NEW),
        insert_before(TARGET, _DESCRIBE_ANCHOR, _DESCRIBE_FRESH),
        insert_after(TARGET, _LOAD_END, _LOAD_FRESH),
        insert_before(TARGET, "    def _get_main_param_and_optimizer_states(self, model_param):\n", _LOADED_BEFORE_FIRST_STEP),
        insert_before(TARGET, _LOAD_DP, "    @torch.no_grad()\n"),
    ]
