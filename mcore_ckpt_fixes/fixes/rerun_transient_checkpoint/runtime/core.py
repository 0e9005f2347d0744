"""rerun-transient-checkpoint's monkeypatch on ``megatron.core.rerun_state_machine``:
``RerunStateMachine.should_checkpoint_and_exit`` and ``load_state_dict`` wrapped, and the probe.
Why: the package's docstring. Imported only when the target module is.
"""

from __future__ import annotations

import logging
import sys
import types
import warnings

from ....engine.layers import layer
from ....engine.patching import is_replacement, original
from .. import ID, MODULE

CLASS = "RerunStateMachine"

# Shared with diff/core.py: the source diff warns with the same words.
IGNORED = (
    "RerunStateMachine state RERUNNING_IN_PLACE in the checkpoint (saved at a transient fault by an "
    "unfixed release) ignored: the in-place rerun's RNG snapshot is never checkpointed, so training "
    "resumes from this checkpoint as from a regular one"
)


@layer(ID, MODULE, "should_checkpoint_and_exit", owner=CLASS)
def should_checkpoint_and_exit(below_us, self):
    """``RerunStateMachine.should_checkpoint_and_exit`` that, where the release asks for a checkpoint
    at a transient fault, first puts the machine back to ``NOT_RUNNING_YET``: the checkpoint then
    holds a state every release resumes from."""
    module = sys.modules[MODULE]
    out = below_us(self)
    if out[0] and self.state == module.RerunState.RERUNNING_IN_PLACE:
        # The in-place rerun is over (the fault was transient and no rerun from a checkpoint is
        # asked for), and the step's RNG snapshot that state needs is never saved: a resumed machine
        # in RERUNNING_IN_PLACE restores None. The step is simply run again after the resume.
        self.state = module.RerunState.NOT_RUNNING_YET
    return out


def saved_state(entry):
    """The machine state a checkpoint's ``rerun_state_machine`` entry holds: in its common part
    (0.14+), or in its sharded part (0.12, 0.13); None where there is none."""
    if not isinstance(entry, dict):
        return None
    if "state" in entry:
        return entry["state"]
    sharded = entry.get("sharded")
    return sharded.get("state") if isinstance(sharded, dict) else None


@layer(ID, MODULE, "load_state_dict", owner=CLASS)
def load_state_dict(below_us, self, state_dict):
    """``RerunStateMachine.load_state_dict`` that ignores, with a warning, a ``RERUNNING_IN_PLACE``
    state an unfixed release saved at a transient fault (the machine stays as the job configured
    it, as for a regular checkpoint); any other entry goes to the release's method."""
    module = sys.modules[MODULE]
    if self.mode != module.RerunMode.DISABLED and saved_state(state_dict) == module.RerunState.RERUNNING_IN_PLACE:
        from ....engine.errors import MegatronPatchWarning

        # stacklevel 3: the caller's line, past @layer's frame.
        warnings.warn(f"mcore_ckpt_fixes: {ID}: {IGNORED}", MegatronPatchWarning, stacklevel=3)
        return None
    return below_us(self, state_dict)


# -- probe: the release's own should_checkpoint_and_exit on an inert stand-in ----------------------


class _StandIn:
    """A machine with only the attributes ``should_checkpoint_and_exit`` reads and sets."""


def _silenced(fn):
    """``fn`` with its module's ``logger`` replaced by a disabled one: the probe runs in a user's job,
    which must not log "Exiting now" at import."""
    silent = logging.Logger(f"{__name__}.probe")
    silent.disabled = True
    scope = dict(fn.__globals__, logger=silent)
    return types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)


def release_exit_at_transient_fault(module):
    """The release's own ``should_checkpoint_and_exit`` on a stand-in machine that validates results
    and found a transient fault in its in-place rerun: (whether it asks for a checkpoint, the state
    it leaves), or None when the module has no such machine."""
    cls = module.__dict__.get(CLASS)
    fn = getattr(cls, "__dict__", {}).get("should_checkpoint_and_exit")
    mode, state = getattr(module, "RerunMode", None), getattr(module, "RerunState", None)
    if fn is None or mode is None or not hasattr(state, "RERUNNING_IN_PLACE"):
        return None
    if is_replacement(fn):
        fn = original(cls, "should_checkpoint_and_exit")
    machine = _StandIn()
    machine.mode, machine.state = mode.VALIDATE_RESULTS, state.RERUNNING_IN_PLACE
    return _silenced(fn)(machine)[0], machine.state


def transient_fault_exit(module):
    """What the release does at that exit: ``"saves-rerunning"`` (asks for a checkpoint and leaves
    the state ``RERUNNING_IN_PLACE``: the bug), ``"resumable"`` (no checkpoint, or one in another
    state), or None when the module has no such machine."""
    seen = release_exit_at_transient_fault(module)
    if seen is None:
        return None
    checkpoint, left = seen
    return "saves-rerunning" if checkpoint and left == module.RerunState.RERUNNING_IN_PLACE else "resumable"


def probe(module: types.ModuleType):
    behaviour = transient_fault_exit(module)
    if behaviour is None:
        return None, f"{MODULE} has no {CLASS}.should_checkpoint_and_exit"
    if behaviour == "saves-rerunning":
        return True, (
            "RerunStateMachine saves a checkpoint in state RERUNNING_IN_PLACE at a transient fault: "
            "a job resumed from it crashes in _restore_state"
        )
    return False, "RerunStateMachine saves no RERUNNING_IN_PLACE state at a transient fault"
