"""engine/bindings.py: every module global that holds a function is found, whichever way it was bound,
while only the modules that can hold it are looked at (a fresh interpreter per case)."""

import textwrap

import pytest

from conftest import check_py

pytestmark = pytest.mark.one_line  # the whole matrix runs it on one line (tools/test.sh)

# ``defs`` defines f, then imports ``child``, which binds it (a circular import: child finishes
# first, so it sits before defs in sys.modules); ``chain`` is imported first and imports ``defs``
# itself (the import chain), binding f under another name after that import; ``after`` is imported
# later and aliases f; ``before`` is imported before ``defs`` exists and never binds it. ``defs``
# is imported through the package's hooks (a hook registered on it wraps its loader), as Megatron's
# modules are.
MODULES = {
    "defs.py": "def f():\n    return 1\n\n\nimport child  # noqa: E402\n",
    "child.py": "from defs import f as from_child\n",
    "before.py": "def g():\n    return 2\n",
    "chain.py": "import defs\nfrom defs import f as chained\n",
    "after.py": "from defs import f as aliased\n",
}


def _write(tmp_path):
    for name, text in MODULES.items():
        (tmp_path / name).write_text(text)


def test_holders_finds_every_binding_and_looks_only_where_one_can_be(tmp_path):
    _write(tmp_path)
    out = check_py(
        textwrap.dedent(
            """
            import sys
            from mcore_ckpt_fixes.engine import bindings, hooks
            hooks.register("defs", lambda module: None)  # the loader of defs is wrapped from now on
            import before
            import chain   # imports defs inside its body: chain is defs' import chain
            import after
            from defs import f as in_main
            walked = []
            real_walk = bindings.index_module
            bindings.index_module = lambda module, namespace: (walked.append(module.__name__), real_walk(module, namespace))
            found = sorted(f"{m.__name__}.{n}" for m, n in bindings.holders(sys.modules["defs"].f))
            print(found)
            print("before" in walked, "chain" in walked, "after" in walked)
            # A later lookup walks nothing that has not changed (only the running script).
            walked.clear()
            bindings.holders(sys.modules["defs"].f)
            print(sorted(set(walked)))
            """
        ),
        env={"PYTHONPATH": str(tmp_path)},
    )
    found, looked, again = out.strip().splitlines()[-3:]
    assert found == "['__main__.in_main', 'after.aliased', 'chain.chained', 'child.from_child', 'defs.f']", found
    assert looked == "False True True", looked  # before finished before f existed: not looked at
    assert again == "['__main__']", again


def test_holders_after_revert_sees_names_rebound_without_new_globals(tmp_path):
    """revert() points names back without changing any namespace's size, including a module imported
    while the fix was applied (it bound the replacement itself): the index is told what revert put
    back, so a later rebind finds every one of them again."""
    _write(tmp_path)
    (tmp_path / "late.py").write_text("from defs import f as bound_late\n")
    out = check_py(
        textwrap.dedent(
            """
            import sys
            from mcore_ckpt_fixes.engine import hooks
            from mcore_ckpt_fixes.engine.patching import Patcher, mark
            hooks.register("defs", lambda module: None)
            import after, defs
            original = defs.f

            @mark("probe")
            def replacement():
                return 3

            patcher = Patcher("probe")
            patcher.replace_function(defs, "f", replacement)
            assert after.aliased is replacement
            import late
            assert late.bound_late is replacement
            from mcore_ckpt_fixes.engine.bindings import holders
            holders(replacement)  # another fix's lookup indexes ``late`` while it holds the replacement
            patcher.revert()
            assert after.aliased is original and defs.f is original and late.bound_late is original
            patcher = Patcher("probe")
            patcher.replace_function(defs, "f", replacement)
            print(after.aliased is replacement, late.bound_late is replacement)
            """
        ),
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert out.strip().splitlines()[-1] == "True True", out
