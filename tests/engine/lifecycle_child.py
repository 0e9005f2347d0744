"""What tests/engine/test_lifecycle.py runs in fresh interpreters: every fix's checks, one fix at a
time in one interpreter per import order (each fix's failure reported apart, so that one fix's
failure is not another's).

Generic over the fix: it learns what a fix changed from the engine's record of its changes, never
from the fix's own code, so every discovered fix gets the same checks.
"""

import importlib
import json
import pickle
import sys
import types


def _stand_ins():
    # tp-group's targets import mamba_ssm on some releases; test infrastructure, as in conftest.py.
    from mcore_ckpt_fixes.testing._standins import install_mamba_ssm_stand_in

    install_mamba_ssm_stand_in()


def import_targets(fix_id):
    """Import every target module of the fix that this release has; the names of those imported."""
    from mcore_ckpt_fixes.engine.registry import ENGINE

    found = []
    for target in ENGINE.discover()[fix_id].targets:
        try:
            importlib.import_module(target.module)
        except ImportError:
            continue  # e.g. megatron.training before 0.17, MIMO before 0.17
        found.append(target.module)
    return found


def snapshot(modules):
    """Every binding of the target modules and of the classes they define, by identity:
    ``{"owner.attr": (owner, attr, object)}``."""
    snap = {}
    for name in modules:
        module = sys.modules[name]
        for attr, value in vars(module).items():
            snap[f"{name}.{attr}"] = (module, attr, value)
            if isinstance(value, type) and value.__module__ == name:
                for cattr, cvalue in vars(value).items():
                    snap[f"{name}.{attr}.{cattr}"] = (value, cattr, cvalue)
    return snap


_MISSING = object()


def unchanged(before):
    """The bindings that no longer hold the object they held in ``before``."""
    return sorted(k for k, (owner, attr, value) in before.items() if vars(owner).get(attr, _MISSING) is not value)


def changes(fix_id):
    from mcore_ckpt_fixes.engine.registry import ENGINE

    return ENGINE.changes(fix_id)


def state(fix_id):
    import mcore_ckpt_fixes

    return next(r for r in mcore_ckpt_fixes.report() if r["id"] == fix_id)["state"]


def megatron_first(fix_id):
    """Megatron (and a user module's ``from x import f``) first; the fix off, then on, twice, after a
    reload; every change a marked replacement in place, one layer, picklable; revert exact."""
    from mcore_ckpt_fixes.engine.patching import MISSING as INHERITED
    from mcore_ckpt_fixes.engine.patching import is_replacement, original

    _stand_ins()
    modules = import_targets(fix_id)
    before = snapshot(modules)
    # A user's module that bound every function of the target modules by name before the fix.
    user = types.ModuleType("user_module_of_the_lifecycle_test_" + fix_id.replace("-", "_"))
    bound = {}
    for owner, attr, value in before.values():
        if isinstance(owner, types.ModuleType) and isinstance(value, types.FunctionType):
            bound[(owner.__name__, attr)] = f"b{len(bound)}"
            setattr(user, bound[(owner.__name__, attr)], value)
    sys.modules[user.__name__] = user

    import mcore_ckpt_fixes  # the environment switches every fix off (or a fix checked before reverted it)

    assert state(fix_id) == "disabled", state(fix_id)
    assert unchanged(before) == [], ("flag off changed Megatron", unchanged(before))
    flags = {"MCORE_CKPT_FIXES": fix_id}
    mcore_ckpt_fixes.apply(flags)
    first = [(r.owner, r.name, r.before, r.after) for r in changes(fix_id)]
    for owner, name, old, new in first:
        assert vars(owner).get(name) is new and is_replacement(new), (owner, name)
        assert not is_replacement(old), ("a second layer", owner, name)
        if old is not INHERITED:
            assert original(owner, name) is old, ("original() does not reach the original", owner, name)
        if isinstance(new, types.FunctionType):
            assert pickle.loads(pickle.dumps(new)) is new, ("not picklable by reference", name)
        key = (getattr(owner, "__name__", None), name)
        # A function replaced where it is defined is replaced in every module that bound it by
        # name; a fix may also replace one module's binding of a function defined elsewhere only.
        if key in bound and getattr(old, "__module__", None) == key[0]:
            assert getattr(user, bound[key]) is new, ("from-import binding not rebound", key)
    mcore_ckpt_fixes.apply(flags)
    importlib.reload(mcore_ckpt_fixes)
    mcore_ckpt_fixes.apply(flags)
    again = [(r.owner, r.name, r.after) for r in changes(fix_id)]
    assert [(o, n, a) for o, n, _, a in first] == again, "apply twice + reload changed what is in place"
    for owner, name, _, new in first:
        assert vars(owner).get(name) is new, ("replaced again", owner, name)
    applied, changed = state(fix_id), in_place(fix_id, modules)
    mcore_ckpt_fixes.revert()
    assert unchanged(before) == [], ("revert left changes", unchanged(before))
    for owner, name, old, _ in first:  # outside the target modules too (a definition site elsewhere)
        assert vars(owner).get(name, INHERITED) is old, ("revert did not restore", owner, name)
    for key, alias in bound.items():
        assert getattr(user, alias) is before[".".join(key)][2], ("from-import binding not restored", key)
    return {"state": applied, "modules": modules, "changed": changed}


def _definition_sites(fix_id):
    """Modules where the fix replaced an object at its definition (a function of that module, or a
    class attribute): a fix may patch a module other than its targets (mimo-optimizer's load side
    wraps ``dist_checkpointing``'s ``load``)."""
    sites = set()
    for r in changes(fix_id):
        if isinstance(r.owner, type):
            sites.add(r.owner.__module__)
        elif isinstance(r.owner, types.ModuleType) and getattr(r.before, "__module__", None) == r.owner.__name__:
            sites.add(r.owner.__name__)
    return sites


def in_place(fix_id, modules):
    """Every binding in the target modules and the fix's definition sites (and the classes they
    define) that holds one of this fix's replacements: what the fix changed, the same whether the
    bindings were rebound (Megatron first) or bound the replacement at import (fix first)."""
    from mcore_ckpt_fixes.engine.patching import MARK, layers

    found = set()
    modules = sorted(set(modules) | _definition_sites(fix_id))
    for owner, attr, value in snapshot(modules).values():
        # Under another fix's layer the attribute holds that one: this fix's layer is in the stack.
        value = next((v for f, v in layers(owner, attr) if f == fix_id), value)
        if getattr(value, MARK, None) == fix_id:
            where = (
                owner.__name__ if isinstance(owner, types.ModuleType) else f"{owner.__module__}:{owner.__qualname__}"
            )
            # A replacement module (numpy2-product's NumPy) is named by itself: its module
            # __getattr__ would send __module__ on to NumPy.
            if isinstance(value, types.ModuleType):
                what = value.__name__
            elif hasattr(value, "__qualname__"):
                what = f"{value.__module__}.{value.__qualname__}"
            else:  # a replacement object (param-group-identity's keys): named by its class
                what = f"{type(value).__module__}.{type(value).__qualname__}()"
            found.add(f"{where}.{attr} = {what}")
    return sorted(found)


def fix_first(fix_ids):
    """The fixes first (nothing heavy imported), Megatron after: the hooks apply them; a spawn child
    (as Megatron's async checkpoint writer starts) sees the same states and the same changes."""
    import mcore_ckpt_fixes  # noqa: F401  (the import itself installs the hooks under test)

    assert "torch" not in sys.modules and "megatron" not in sys.modules
    for fix_id in fix_ids:
        assert state(fix_id) in ("pending", "not-applicable"), (fix_id, state(fix_id))
    _stand_ins()
    mine = _observed(fix_ids)
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        child = pool.apply(spawn_child, (fix_ids,))
    return {fix_id: {"parent": mine[fix_id], "spawn": child[fix_id]} for fix_id in fix_ids}


def _observed(fix_ids):
    modules = {fix_id: import_targets(fix_id) for fix_id in fix_ids}
    return {
        fix_id: {"state": state(fix_id), "modules": modules[fix_id], "changed": in_place(fix_id, modules[fix_id])}
        for fix_id in fix_ids
    }


def spawn_child(fix_ids):
    """In a spawn child: importing this module's parent package path runs nothing of ours; the
    fixes apply when the child imports mcore_ckpt_fixes and the target modules, as a worker does."""
    import mcore_ckpt_fixes  # noqa: F401

    _stand_ins()
    return _observed(fix_ids)


def megatron_first_each(fix_ids):
    """``megatron_first`` for each fix in turn (each reverted before the next); a failed check is
    that fix's result, the others still run."""
    import traceback

    out = {}
    for fix_id in fix_ids:
        try:
            out[fix_id] = megatron_first(fix_id)
        except Exception:
            out[fix_id] = {"error": traceback.format_exc()}
    return out


if __name__ == "__main__":
    mode, fix_ids = sys.argv[1], sys.argv[2].split(",")
    out = megatron_first_each(fix_ids) if mode == "megatron-first" else fix_first(fix_ids)
    print("RESULT " + json.dumps(out))
