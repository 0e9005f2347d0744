"""Import-order, rebind, reload, revert and spawn behaviour, each in a fresh interpreter.

Two fixes are exercised on real Megatron-Core modules:
* ``engine-probe`` (tests/engine/probe_fix.py): a counting wrapper around
  ``megatron.core.utils.make_sharded_tensor_for_checkpoint``, applicable on every release;
* ``tp-group`` where the release has the bug (0.16-0.18): its constructor wrapper must take hold.
"""

import pytest

from conftest import check_py

pytestmark = pytest.mark.one_line  # the whole matrix runs it on one line (tools/test.sh)

# dtensor-placement replaces the same helper as engine-probe, and a second fix never stacks a layer
# on another fix's replacement: switch it off where engine-probe's own behaviour is under test.
PROBE_ENV = {"MCORE_CKPT_FIX_DTENSOR_PLACEMENT": "off"}

PRELUDE = """
import importlib, sys, warnings
import probe_fix
"""


def test_fixes_imported_first_then_megatron():
    out = check_py(
        PRELUDE
        + """
import mcore_ckpt_fixes
probe_fix.register(); mcore_ckpt_fixes.apply()
assert 'torch' not in sys.modules and 'megatron' not in sys.modules
state = {r['id']: r['state'] for r in mcore_ckpt_fixes.report()}
assert state['engine-probe'] == 'pending', state
import megatron.core.utils as mu
import megatron.core.transformer.utils as tu
assert mu.make_sharded_tensor_for_checkpoint is probe_fix.counting_make_sharded_tensor
assert tu.make_sharded_tensor_for_checkpoint is probe_fix.counting_make_sharded_tensor
print({r['id']: r['state'] for r in mcore_ckpt_fixes.report()}['engine-probe'])
""",
        env=PROBE_ENV,
    )
    assert out.strip() == "applied"


def test_megatron_imported_first_and_from_import_rebound():
    check_py(
        """
import sys
import megatron.core.utils as mu
from megatron.core.utils import make_sharded_tensor_for_checkpoint   # bound before the fix
keep = {'early': make_sharded_tensor_for_checkpoint}
import megatron.core.transformer.utils as tu
mod = type(sys)('user_module'); mod.helper = keep['early']; sys.modules['user_module'] = mod
import probe_fix, mcore_ckpt_fixes
probe_fix.register(); mcore_ckpt_fixes.apply()
new = probe_fix.counting_make_sharded_tensor
assert mu.make_sharded_tensor_for_checkpoint is new
assert tu.make_sharded_tensor_for_checkpoint is new, 'a Megatron module that did from-import'
assert sys.modules['user_module'].helper is new, 'a user module that did from-import'
assert make_sharded_tensor_for_checkpoint is new, 'this script did from-import too'
mcore_ckpt_fixes.revert()
early = keep['early']
assert mu.make_sharded_tensor_for_checkpoint is early
assert tu.make_sharded_tensor_for_checkpoint is early
assert sys.modules['user_module'].helper is early
assert make_sharded_tensor_for_checkpoint is early
""",
        env=PROBE_ENV,
    )


def test_apply_twice_and_reload_leave_one_layer():
    check_py(
        PRELUDE
        + """
import mcore_ckpt_fixes
import megatron.core.utils as mu
# Held in a dict: the engine rebinds module globals by identity, this script's own included.
keep = {'orig': mu.make_sharded_tensor_for_checkpoint}
probe_fix.register()
for _ in range(3):
    mcore_ckpt_fixes.apply()
importlib.reload(mcore_ckpt_fixes)
probe_fix.register(); mcore_ckpt_fixes.apply()
import torch
t = torch.zeros(2)
probe_fix.CALLS.clear()
try:  # without parallel_state the original asserts: reaching that assertion proves it was called
    mu.make_sharded_tensor_for_checkpoint(t, 'k', replica_id=0)
except AssertionError as exc:
    assert 'not initialized' in str(exc), exc
assert probe_fix.CALLS == ['k'], probe_fix.CALLS        # one layer: one call recorded
from mcore_ckpt_fixes.engine.patching import original
assert original(mu, 'make_sharded_tensor_for_checkpoint') is keep['orig']
mcore_ckpt_fixes.revert()
assert mu.make_sharded_tensor_for_checkpoint is keep['orig']
""",
        env=PROBE_ENV,
    )


def test_revert_then_apply_again():
    check_py(
        PRELUDE
        + """
import mcore_ckpt_fixes
probe_fix.register(); mcore_ckpt_fixes.apply()
import megatron.core.utils as mu
keep = {'orig': mcore_ckpt_fixes.engine.patching.original(mu, 'make_sharded_tensor_for_checkpoint')}
mcore_ckpt_fixes.revert()
assert mu.make_sharded_tensor_for_checkpoint is keep['orig']
assert {r['id']: r['state'] for r in mcore_ckpt_fixes.report()}['engine-probe'] == 'disabled'
mcore_ckpt_fixes.apply()
assert mu.make_sharded_tensor_for_checkpoint is probe_fix.counting_make_sharded_tensor
""",
        env=PROBE_ENV,
    )


def test_revert_restores_bindings_made_while_applied():
    """A module imported while the fix was applied bound the replacement by name itself (no record
    of ours covers it): revert() must point it back at the original too."""
    check_py(
        PRELUDE
        + """
import types
import mcore_ckpt_fixes
probe_fix.register(); mcore_ckpt_fixes.apply()
import megatron.core.utils as mu
late = types.ModuleType("late_user_module")
exec("from megatron.core.utils import make_sharded_tensor_for_checkpoint", late.__dict__)
sys.modules[late.__name__] = late
assert late.make_sharded_tensor_for_checkpoint is probe_fix.counting_make_sharded_tensor
# In a dict: a module global holding the original would itself be rebound by apply (by identity).
keep = {'orig': mcore_ckpt_fixes.engine.patching.original(mu, 'make_sharded_tensor_for_checkpoint')}
mcore_ckpt_fixes.revert()
assert late.make_sharded_tensor_for_checkpoint is keep['orig']
assert mu.make_sharded_tensor_for_checkpoint is keep['orig']
# The fix module's own definition is not a binding: it stays the replacement, and apply works again.
assert mcore_ckpt_fixes.engine.patching.is_replacement(probe_fix.counting_make_sharded_tensor)
mcore_ckpt_fixes.apply()
assert mu.make_sharded_tensor_for_checkpoint is probe_fix.counting_make_sharded_tensor is not keep['orig']
assert late.make_sharded_tensor_for_checkpoint is probe_fix.counting_make_sharded_tensor
""",
        env=PROBE_ENV,
    )


def test_spawn_child_calls_fixed_function():
    out = check_py(
        PRELUDE
        + """
import multiprocessing as mp
import mcore_ckpt_fixes
probe_fix.register(); mcore_ckpt_fixes.apply()
import megatron.core.utils as mu

def main():
    ctx = mp.get_context('spawn')
    with ctx.Pool(1) as pool:
        # The replacement itself travels by reference, as Megatron's async writer pickles functions.
        fn = mu.make_sharded_tensor_for_checkpoint
        assert fn is probe_fix.counting_make_sharded_tensor
        print(pool.apply(child, (fn,)))

def child(fn):
    import torch, probe_fix
    try:  # the original asserts without parallel_state: reaching it proves the chain works
        fn(torch.ones(3), 'spawned', replica_id=0)
        reached = 'no assertion'
    except AssertionError as exc:
        reached = 'original reached' if 'not initialized' in str(exc) else repr(exc)
    return (reached, probe_fix.CALLS)

if __name__ == '__main__':
    main()
""",
        env=PROBE_ENV,
    )
    assert "('original reached', ['spawned'])" in out, out


def test_importing_fixes_alone_imports_neither_torch_nor_megatron():
    out = check_py(
        """
import sys, mcore_ckpt_fixes
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'numpy'))
print(heavy)
"""
    )
    assert out.strip() == "[]"


def test_probe_of_a_target_imported_inside_a_circular_chain_waits_for_the_chain(tmp_path):
    """Megatron-LM main: importing mamba_layer runs, deep inside, the import of a module whose own
    import is still running higher up (optimizer -> fsdp_dtensor_checkpoint -> ... -> mamba_layer).
    A probe that needs the half-initialised module must not fail: it runs again once the outermost
    import has finished. Rebuilt here with a tracked package of two modules."""
    pkg = tmp_path / "chainpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "outer.py").write_text("import chainpkg.target\nREADY = True\n")
    (pkg / "target.py").write_text("def f():\n    return 'original'\n")
    check_py(
        f"""
import sys
sys.path.insert(0, {str(tmp_path)!r})
import mcore_ckpt_fixes
from mcore_ckpt_fixes.engine import hooks
from mcore_ckpt_fixes.engine.fix import Fix, Target
from mcore_ckpt_fixes.engine.patching import mark
from mcore_ckpt_fixes.engine.registry import ENGINE
hooks.TRACKED_PACKAGES = hooks.TRACKED_PACKAGES + ("chainpkg",)

@mark("chain-probe")
def fixed():
    return "fixed"

def probe(module):
    from chainpkg.outer import READY  # ImportError while chainpkg.outer is still executing
    return True, "needs chainpkg.outer"

def apply(module, patcher):
    patcher.replace_function(module, "f", fixed)

ENGINE.register(Fix(id="chain-probe", summary="test", affected=">=0", targets=(Target("chainpkg.target", probe, apply),)))
mcore_ckpt_fixes.apply()
import chainpkg.outer
row = {{r["id"]: r for r in mcore_ckpt_fixes.report()}}["chain-probe"]
assert row["state"] == "applied", row
assert sys.modules["chainpkg.target"].f() == "fixed"
"""
    )
