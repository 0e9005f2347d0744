"""A test-only fix on a real Megatron-Core target that exists in every release we test.

The import-order tests need a fix that applies on every release, 0.19.2 included, where no product
fix applies to the modules involved. It wraps ``megatron.core.utils.make_sharded_tensor_for_checkpoint``
(which ``megatron.core.transformer.utils`` binds with ``from ... import``) and counts calls.
"""

from mcore_ckpt_fixes.engine.fix import Fix, Target
from mcore_ckpt_fixes.engine.patching import mark, original

TARGET = "megatron.core.utils"
NAME = "make_sharded_tensor_for_checkpoint"
CALLS = []


@mark("engine-probe")
def counting_make_sharded_tensor(*args, **kwargs):
    CALLS.append(args[1] if len(args) > 1 else kwargs.get("key"))
    return original(TARGET, NAME)(*args, **kwargs)


def probe(module):
    return (True, "test fix always applies") if hasattr(module, NAME) else (None, "no such helper")


def apply(module, patcher):
    patcher.replace_function(module, NAME, counting_make_sharded_tensor)


FIX = Fix(
    id="engine-probe", summary="test-only counting wrapper", affected=">=0", targets=(Target(TARGET, probe, apply),)
)


def register():
    from mcore_ckpt_fixes.engine.registry import ENGINE

    ENGINE.register(FIX)
