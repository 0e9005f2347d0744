"""No probe, and no replacement, sets a global of a module for the length of a call: a probe runs
the release's code on stand-ins in a copy of the module's globals (``engine.probing.module_scope``,
``module_scopes``, ``with_globals``), and a fix changes a module only through its patcher at apply,
where ``changes()`` and ``revert()`` see it.

Read from the source of every fix's ``runtime/`` (a flip that is undone in a ``finally`` leaves no
trace to observe afterwards): outside the functions named ``apply*``, no assignment, ``del``,
``setattr`` / ``delattr`` or ``__dict__`` write on a name that holds a module (a parameter named
like one, or a name bound from ``sys.modules[...]``, ``importlib.import_module(...)`` or an
``import``). The checker itself is shown to catch each form on a sample.
"""

from __future__ import annotations

import ast
import glob
import os
import textwrap

from conftest import ROOT

MODULE_PARAMS = {"module", "mod", "ckpt", "uneven", "serialization", "strategies", "utils", "home", "dm"}
DICT_WRITES = {"update", "pop", "setdefault", "clear", "__setitem__", "__delitem__", "popitem"}
# Left as they are, with the reason: a torch without DeviceMesh's ``_rank`` argument (2.6, the
# 0.12 sweep's) asks ``device_mesh.get_rank()`` for this process's coordinate; the stand-in mesh of
# two probes answers it for the length of the mesh's construction.
ALLOWED = {
    ("dtensor_placement/runtime/core.py", "probe_dtensor", "dm"),
    ("fsdp2_swiglu_split/runtime/core.py", "_probe_mesh", "dm"),
}


def _module_names(func) -> set:
    names = {a.arg for a in func.args.args + func.args.kwonlyargs if a.arg in MODULE_PARAMS}
    for node in ast.walk(func):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names if alias.asname)
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Subscript, ast.Call)):
            source = ast.unparse(node.value)
            if source.startswith("sys.modules[") or source.startswith("importlib.import_module("):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _holder(node):
    """The name an expression like ``x.attr`` / ``x.__dict__[k]`` / ``self.module.attr`` writes on."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        base = node.value
        if isinstance(base, ast.Attribute) and base.attr == "__dict__":
            base = base.value
        if isinstance(base, ast.Name):
            return base.id
        if isinstance(base, ast.Attribute) and base.attr == "module" and getattr(base.value, "id", None) == "self":
            return "self.module"
    return None


def writes_on_modules(source: str, path: str = "<sample>"):
    """``[(path, function, name, line)]`` for every write on a module-holding name outside ``apply*``."""
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or func.name.startswith("apply"):
            continue
        modules = _module_names(func) | {"self.module"}
        for node in ast.walk(func):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    name = _holder(t)
                    if name in modules:
                        found.append((path, func.name, name, node.lineno))
            if isinstance(node, ast.Call):
                fn = node.func
                if isinstance(fn, ast.Name) and fn.id in ("setattr", "delattr") and node.args:
                    arg = node.args[0]
                    name = arg.id if isinstance(arg, ast.Name) else _holder(ast.Attribute(arg, "x"))
                    if name in modules:
                        found.append((path, func.name, name, node.lineno))
                elif (
                    isinstance(fn, ast.Attribute)
                    and fn.attr in DICT_WRITES
                    and isinstance(fn.value, ast.Attribute)
                    and fn.value.attr == "__dict__"
                ):
                    name = _holder(ast.Attribute(fn.value.value, "x"))
                    if name in modules:
                        found.append((path, func.name, name, node.lineno))
    return found


def test_no_fix_writes_a_module_global_outside_apply():
    base = os.path.join(ROOT, "mcore_ckpt_fixes", "fixes")
    found = []
    for path in sorted(glob.glob(os.path.join(base, "*", "runtime", "*.py"))):
        rel = os.path.relpath(path, base)
        with open(path) as f:
            found += [w for w in writes_on_modules(f.read(), rel) if (w[0], w[1], w[2]) not in ALLOWED]
    assert found == [], found


def test_the_checker_sees_each_form():
    sample = textwrap.dedent(
        """
        import sys, importlib

        def probe(module, fn):
            module.X = 1
            module.__dict__["Y"] = 2
            module.__dict__.update(Z=3)
            setattr(module, "W", 4)
            del module.V
            other = sys.modules["megatron.core.utils"]
            other.U = 5
            loaded = importlib.import_module("x")
            loaded.__dict__.pop("T")

        class Swap:
            def __enter__(self):
                self.module.S = 6

        def apply(module, patcher):
            module.allowed = 7
        """
    )
    lines = sorted(w[3] for w in writes_on_modules(sample))
    assert lines == [5, 6, 7, 8, 9, 11, 13, 17], writes_on_modules(sample)
