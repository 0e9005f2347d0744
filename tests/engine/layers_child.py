"""Child of tests/engine/test_all_fixes.py: fixes layered on one attribute. Two test-only fixes
wrap ``megatron.core.utils.make_sharded_tensor_for_checkpoint`` (bound by name in
``megatron.core.transformer.utils``) besides whatever product fix wraps it on this release; each
records its name and calls the layer below. Prints, as JSON, what each step saw."""

import json
import sys

import probe_fix

from mcore_ckpt_fixes.engine.fix import Fix, Target
from mcore_ckpt_fixes.engine.patching import Patcher, below, has_layer, mark, original

CALLS = []


@mark("layer-low")
def low(*args, **kwargs):
    CALLS.append("low")
    return below("layer-low", probe_fix.TARGET, probe_fix.NAME)(*args, **kwargs)


@mark("layer-high")
def high(*args, **kwargs):
    CALLS.append("high")
    return below("layer-high", probe_fix.TARGET, probe_fix.NAME)(*args, **kwargs)


def _fix(fix_id, fn):
    def apply(module, patcher):
        patcher.replace_function(module, probe_fix.NAME, fn)

    return Fix(
        id=fix_id, summary="test layer", affected=">=0", targets=(Target(probe_fix.TARGET, probe_fix.probe, apply),)
    )


def _call():
    """Through the alias binding (``from megatron.core.utils import ...``), as Megatron calls it."""

    CALLS.clear()
    return {"calls": list(CALLS) if _outcome(alias.make_sharded_tensor_for_checkpoint) == RELEASE_OUTCOME else None}


def _outcome(fn):
    """What the call gives outside an initialised world (every release asks parallel_state for the
    tensor-parallel group and stops there): the layers must hand it through unchanged."""
    import torch

    try:
        return repr(fn(torch.zeros(2), "k").key)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _held():
    return [getattr(utils.make_sharded_tensor_for_checkpoint, "__mcore_ckpt_fix__", None),
            getattr(alias.make_sharded_tensor_for_checkpoint, "__mcore_ckpt_fix__", None)]  # fmt: skip


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    import megatron.core.transformer.utils as alias
    import megatron.core.utils as utils

    from mcore_ckpt_fixes.engine.registry import ENGINE

    release = original(utils, probe_fix.NAME)  # the import applied the product fixes already
    RELEASE_OUTCOME = _outcome(release)
    # Their layers follow the declared order (fixes.ORDER, then registration): low under high.
    ENGINE.register(_fix("layer-low", low))
    ENGINE.register(_fix("layer-high", high))
    import mcore_ckpt_fixes

    mcore_ckpt_fixes.apply()
    rows = {r["id"]: r for r in mcore_ckpt_fixes.report()}
    product = [f for f in ENGINE.fixes if f not in ("layer-low", "layer-high") and has_layer(f, utils, probe_fix.NAME)]
    out = {"states": [rows["layer-low"]["state"], rows["layer-high"]["state"]], "product_layers": product}
    out["all"] = {
        "held": _held(),
        **_call(),
        "changes": [len(ENGINE.changes("layer-low")), len(ENGINE.changes("layer-high"))],
    }
    mcore_ckpt_fixes.revert(["layer-high"])
    out["high_reverted"] = {"held": _held(), **_call()}
    mcore_ckpt_fixes.apply()
    out["high_again"] = {"held": _held(), **_call()}
    mcore_ckpt_fixes.revert(["layer-low"])
    out["low_reverted"] = {
        "held": _held(),
        **_call(),
        "high_below_is_release": below("layer-high", utils, probe_fix.NAME) is release,
    }
    mcore_ckpt_fixes.revert()
    out["all_reverted"] = {"release_back": [utils.make_sharded_tensor_for_checkpoint is release,
                                            alias.make_sharded_tensor_for_checkpoint is release], **_call()}  # fmt: skip

    # Applied in the other order than declared: the lower-ranked layer still goes under.
    upper, lower = Patcher("layer-high", rank=2), Patcher("layer-low", rank=1)
    upper.replace_function(utils, probe_fix.NAME, high)
    lower.replace_function(utils, probe_fix.NAME, low)
    out["out_of_order"] = {"held": _held(), **_call()}
    lower.revert()
    upper.revert()
    out["out_of_order_reverted"] = (
        utils.make_sharded_tensor_for_checkpoint is release and original(utils, probe_fix.NAME) is release
    )

    # A marked replacement no layer here put there (another copy of the package): the fix fails at
    # apply, one line naming both; the attribute keeps what it held.
    @mark("foreign-copy")
    def foreign(*args, **kwargs):
        return release(*args, **kwargs)

    utils.make_sharded_tensor_for_checkpoint = foreign
    mcore_ckpt_fixes.apply()
    rows = {r["id"]: r for r in mcore_ckpt_fixes.report()}
    out["conflict"] = {"state": rows["layer-low"]["state"], "reason": rows["layer-low"]["reason"],
                       "kept": utils.make_sharded_tensor_for_checkpoint is foreign}  # fmt: skip
    print(json.dumps(out))
    sys.stdout.flush()
