"""rerun-state-constant-structure's monkeypatch on ``megatron.core.rerun_state_machine``:
``RerunStateMachine.state_dict`` wrapped, and the probe. Why: the package's docstring.
Imported only when the target module is.
"""

from __future__ import annotations

import sys
import types

from ....engine.layers import layer
from ....engine.patching import is_replacement, original
from .. import ID, MODULE

CLASS = "RerunStateMachine"


@layer(ID, MODULE, "state_dict", owner=CLASS)
def state_dict(release, self, data_iterator, ckpt_format, force=False):
    """``RerunStateMachine.state_dict`` whose torch_dist structure does not depend on whether a rerun
    is pending: with none pending the release's own full state (``force=True``) with no data
    iterator, which is what a later fault-time save adds to a plan cached from this one."""
    module = sys.modules[MODULE]
    if (
        not force
        and ckpt_format == "torch_dist"
        and self.mode != module.RerunMode.DISABLED
        and self.state == module.RerunState.NOT_RUNNING_YET
    ):
        # No replay buffers to keep: the iterators are only sanitized (must be RerunDataIterator)
        # when a rerun is pending.
        return release(self, None, ckpt_format, force=True)
    return release(self, data_iterator, ckpt_format, force=force)


# -- probe: the release's own state_dict on an inert stand-in ----------------------------------------


class _PastTheShortCut(Exception):
    pass


def steady_state_structure(module):
    """What the release's ``state_dict`` does for a validating machine with no rerun pending
    (``torch_dist``): ``"none"`` (returns None: the bug), ``"kept"`` (goes on to build its state),
    or None when the module has no such method. Runs on a stand-in that raises at the first
    attribute past ``mode`` and ``state``: nothing is built, no process group is needed."""
    cls = module.__dict__.get(CLASS)
    fn = getattr(cls, "__dict__", {}).get("state_dict")
    mode, state = getattr(module, "RerunMode", None), getattr(module, "RerunState", None)
    if fn is None or mode is None or state is None:
        return None
    if is_replacement(fn):
        fn = original(cls, "state_dict")

    class StandIn:
        def __getattr__(self, name):
            raise _PastTheShortCut(name)

    machine = StandIn()
    machine.__dict__.update(mode=mode.VALIDATE_RESULTS, state=state.NOT_RUNNING_YET)
    try:
        out = fn(machine, None, "torch_dist")
    except _PastTheShortCut:
        return "kept"
    return "none" if out is None else "kept"


def probe(module: types.ModuleType):
    behaviour = steady_state_structure(module)
    if behaviour is None:
        return None, f"{MODULE} has no {CLASS}.state_dict"
    if behaviour == "none":
        return True, (
            "RerunStateMachine.state_dict returns None while no rerun is pending: a save plan cached "
            "from such a save (--ckpt-assume-constant-structure) drops the fault-time rerun state"
        )
    return False, "RerunStateMachine.state_dict keeps one structure whether a rerun is pending or not"
