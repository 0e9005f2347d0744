"""NumPy as Megatron-Core 0.12-0.15's ``dist_checkpointing`` calls it: NumPy itself, with
``product``, the alias of ``numpy.prod`` that NumPy 2.0 removed.

A module, not a proxy object: bound as ``np`` in the patched modules (runtime/core.py), it is found
by reference wherever those modules' functions are pickled. Every other name is NumPy's own object
(module ``__getattr__``), so ``np.ndarray`` checks and NumPy's scalars are unchanged.
"""

import numpy as _numpy

from .. import ID

__mcore_ckpt_fix__ = ID  # the engine's mark of a replacement: a second apply adds no layer

product = _numpy.prod


def __getattr__(name):
    return getattr(_numpy, name)
