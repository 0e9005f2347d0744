"""rerun-state-strict-load in a job: the layer on dist_checkpointing's mismatch check and the
probe. Why: the fix's page (doc.md). Imported only when the target module is.
"""

from __future__ import annotations

import logging
import types

from ....engine.layers import layer
from ....engine.patching import original
from .. import FUNCTION, ID, MODULE, RERUN_KEY

logger = logging.getLogger("mcore_ckpt_fixes")


@layer(ID, MODULE, FUNCTION)
def _determine_missing_and_unexpected_keys(release, ckpt_sharded_metadata, local_metadata, global_metadata=None):
    """The release's mismatch check, without the rerun state among the missing keys: no rank asks
    for it exactly when ``load_checkpoint`` decided to ignore it (no rerun to restore, another
    topology, ``--finetune``), which is no mismatch the user could mend."""
    missing_keys, unexpected_keys = release(ckpt_sharded_metadata, local_metadata, global_metadata)
    if RERUN_KEY in missing_keys:
        logger.debug("%s: %s in the checkpoint, not asked for: ignored on purpose by the load", ID, RERUN_KEY)
        missing_keys = missing_keys - {RERUN_KEY}
    return missing_keys, unexpected_keys


# -- probe: the release's own check on a checkpoint and a request described by metadata alone ------


class _Key:
    """The one attribute the check reads of a ShardedBase: its key."""

    def __init__(self, key):
        self.key = key


def missing_rerun_state(fn):
    """What ``fn`` reports for a checkpoint with a model tensor and the rerun state, loaded by a
    request for the model only (as ``load_checkpoint`` builds it with no rerun pending): whether the
    rerun state is among the missing keys. Metadata stand-ins only: nothing is read or built."""
    ckpt = {"model.w": _Key("model.w"), f"{RERUN_KEY}/shard_0_1": _Key(RERUN_KEY)}
    request = [_Key("model.w")]
    missing, _ = fn(ckpt, request, [request])
    return RERUN_KEY in missing


def probe(module: types.ModuleType):
    if FUNCTION not in module.__dict__:
        return None, f"{MODULE} has no {FUNCTION}"
    fn = original(module, FUNCTION)  # the release's, whether the fix is in place or not
    try:
        buggy = missing_rerun_state(fn)
    except Exception as exc:  # code this probe does not know: left alone, with the reason
        return None, f"{MODULE}.{FUNCTION} could not be judged ({type(exc).__name__}: {exc})"
    if buggy:
        return True, (
            "the strict-load check counts rerun_state_machine_state as missing when the load leaves it out "
            "on purpose: raise_all stops every rank"
        )
    return False, "the strict-load check does not count an ignored rerun state as missing"
