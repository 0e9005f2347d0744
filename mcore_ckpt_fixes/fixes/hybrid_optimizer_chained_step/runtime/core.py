"""hybrid-optimizer-chained-step in a job: the layer on ``ChainedOptimizer._synchronize_steps`` and
the probe. Why: doc.md.

The release computes the step common to the chained optimizers' param groups and writes it into
every group; where no group keeps a step it writes None. The layer lets the release do it, then
gives every group into which it wrote None what that group had before: no ``step`` at all (a
hybrid optimizer's groups), or its own. Groups that got a real step keep it, as the release does.
"""

from __future__ import annotations

import types

from ....engine.layers import layer
from ....engine.patching import original
from .. import CLASS, FUNCTION, ID, MODULE

_ABSENT = object()


def _groups(chained):
    return [group for inner in chained.chained_optimizers for group in inner.optimizer.param_groups]


@layer(ID, MODULE, FUNCTION, owner=CLASS)
def synchronize_steps(release, self):
    """The release's step alignment, without the None it writes where no group keeps a step."""
    before = [(group, group.get("step", _ABSENT)) for group in _groups(self)]
    step = release(self)
    for group, had in before:
        if group.get("step", _ABSENT) is None and had is not None:
            if had is _ABSENT:
                del group["step"]
            else:
                group["step"] = had
    return step


# -- probe: the release's alignment of two optimizers whose groups keep no step ------------------


def writes_none_where_no_step(cls) -> bool:
    """Does the release's ``_synchronize_steps``, on two stand-in optimizers whose param groups keep
    no step (as a hybrid optimizer's), write a None step into them?"""
    inner = [types.SimpleNamespace(optimizer=types.SimpleNamespace(param_groups=[{"params": [0]}])) for _ in "ab"]
    chained = types.SimpleNamespace(chained_optimizers=inner)
    original(cls, FUNCTION)(chained)
    return any("step" in group and group["step"] is None for group in _groups(chained))


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or FUNCTION not in cls.__dict__:
        return None, f"{MODULE} has no {CLASS}.{FUNCTION}"
    if writes_none_where_no_step(cls):
        return True, (
            f"{CLASS}.{FUNCTION} writes step None into param groups that keep no step (a hybrid optimizer's): "
            "the load or the next step fails"
        )
    return False, f"{CLASS}.{FUNCTION} leaves param groups that keep no step without one"
