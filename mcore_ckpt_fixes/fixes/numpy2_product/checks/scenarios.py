"""numpy2-product's round trip as the suite and ``selftest`` find it (no torch, no Megatron here):
a GPT (Megatron's DDP) saved and loaded through the fully parallel strategies, on 2 gloo ranks
(checks/core.py); tests/fixes/test_numpy2_product.py also runs the case with the distributed
optimizer in the release's default format, in the same world.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"


def _no_product() -> str:
    """The installed NumPy's own error for the removed alias (its wording changed within NumPy 2:
    "`np.product` was removed in the NumPy 2.0 release. Use `np.prod` instead.", later "module
    'numpy' has no attribute 'product'"); with NumPy 1 there is none and the fix is not needed."""
    import numpy

    try:
        numpy.product  # noqa: B018
    except AttributeError as e:
        return f"AttributeError: {e}"
    return "(none: this NumPy has np.product)"


# Raised by the first np.product a save reaches (the fully parallel exchange sizes each shard
# before anything is written).
NO_PRODUCT = Bug.raises("save", _no_product())

SCENARIOS = (
    Scenario(
        ID,
        "model",
        f"{_CORE}:model",
        2,
        {">=0.12.0,<0.16.0": NO_PRODUCT},
        prepare=f"{_CORE}:prepare",
        devices=("cpu",),
        doc="a GPT saved and loaded with the fully parallel strategies (NumPy 2)",
    ),
)
