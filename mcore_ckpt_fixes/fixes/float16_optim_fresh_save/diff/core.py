"""float16-optim-fresh-save as Megatron-Core would carry it: in
``megatron/core/optimizer/optimizer.py``, ``Float16OptimizerWithFloat16Params.sharded_state_dict``
also creates the optimizer's zero moments for a save request of an optimizer without state, and
drops them once the state dict holds them; ``load_state_dict`` gives a checkpoint of torch's Adam
saved before its first step the step 0 it lacks, and leaves an optimizer that loaded such a
checkpoint without state. The helpers, from runtime/core.py's replacement section (the code the
monkeypatch runs), go in above the class. tests/patches runs the same round trips with the
monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace, insert_after, insert_before, replacement_section

OPTIMIZER = "megatron/core/optimizer/optimizer.py"

_SAVE = (
    "        if is_loading:\n"
    "            self.init_state_fn(self.optimizer, self.config)\n"
    "\n"
    "        state_dict = self.state_dict()\n"
    "\n"
)
_SAVE_FRESH = (
    "        # A save before the first step describes the zero moments Adam starts from (a load asks for them).\n"
    "        fresh_save = not is_loading and _without_optimizer_state(self)\n"
    "        if is_loading or fresh_save:\n"
    "            self.init_state_fn(self.optimizer, self.config)\n"
    "\n"
    "        state_dict = self.state_dict()\n"
    "        if fresh_save:\n"
    "            _drop_optimizer_state(self)\n"
    "\n"
)
_COMMON_STEP = "        if 'common_step' in state_dict[optimizer_key]['state']:\n"
_STEP_ZERO = (
    "        if _stepless_zero_moments(self, state_dict[optimizer_key]):\n"
    "            state_dict[optimizer_key]['state']['common_step'] = torch.tensor(0.0)\n"
)
_LOAD = "        self.optimizer.load_state_dict(state_dict[optimizer_key])\n"
_LEFT_WITHOUT_STATE = (
    "        if _loaded_before_first_step(self):\n"
    "            _drop_optimizer_state(self)  # as the run that saved it: Adam starts from zero moments\n"
)


def _helpers() -> str:
    from ..runtime import core

    return replacement_section(core).strip("\n") + "\n\n\n"


def source_edits(release: str) -> list:
    return [
        Replace(OPTIMIZER, _SAVE, _SAVE_FRESH),
        insert_before(OPTIMIZER, _COMMON_STEP, _STEP_ZERO),
        insert_after(OPTIMIZER, _LOAD, _LEFT_WITHOUT_STATE),
        insert_before(OPTIMIZER, "class Float16OptimizerWithFloat16Params(", _helpers()),
    ]
