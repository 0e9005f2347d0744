"""Imports point one way, as CONTRIBUTING.md states: engine -> each fix's declaration and runtime/ ->
testing/ -> each fix's checks/ -> resume/ -> cli/; no module of the package imports a module of a
layer above its own (read from the source with ``ast``: function-level imports count too). The
doctor, the catalogue and the diff builders sit beside the layers and import no fix's checks.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "mcore_ckpt_fixes")
LAYERS = ("engine", "runtime", "testing", "checks", "resume", "cli")


def layer(module: str):
    """The layer of a module of the package, or None for one outside the layers."""
    parts = module.split(".")[1:]
    if not parts:
        return None
    if parts[0] == "fixes":
        if len(parts) >= 3 and parts[2] in ("checks", "runtime", "diff"):
            return {"runtime": 1, "checks": 3, "diff": None}[parts[2]]
        return 1  # a fix's declaration, or fixes/__init__ (ORDER)
    return {"engine": 0, "testing": 2, "resume": 4, "cli": 5}.get(parts[0])


def imports(path, module):
    """Every module of the package that ``path`` (module ``module``) imports, at any depth."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith("mcore_ckpt_fixes"))
    return found


def modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield path, rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


@pytest.mark.one_line
def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for path, module in modules():
        own = layer(module)
        if own is None:
            continue
        for target in imports(path, module):
            other = layer(target)
            if other is not None and other > own:
                upward.append(f"{module} ({LAYERS[own]}) imports {target} ({LAYERS[other]})")
    assert sorted(set(upward)) == [], "\n".join(sorted(set(upward)))


@pytest.mark.one_line
def test_beside_the_layers_nothing_imports_checks_resume_or_cli():
    beside = []
    for path, module in modules():
        if layer(module) is not None:
            continue
        for target in imports(path, module):
            if layer(target) in (3, 4, 5) and not module.startswith("mcore_ckpt_fixes.__main__"):
                beside.append(f"{module} imports {target}")
    assert sorted(set(beside)) == [], "\n".join(sorted(set(beside)))


def test_the_layering_sees_an_upward_import(tmp_path):
    """The check itself: a runtime module that imports a fix's checks is caught."""
    bad = tmp_path / "core.py"
    bad.write_text("from ..checks import core\n")
    found = imports(str(bad), "mcore_ckpt_fixes.fixes.some_fix.runtime.core")
    assert "mcore_ckpt_fixes.fixes.some_fix.checks.core" in found
    assert layer("mcore_ckpt_fixes.fixes.some_fix.checks.core") > layer("mcore_ckpt_fixes.fixes.some_fix.runtime.core")
