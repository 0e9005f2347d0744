"""No underscore name is used from another module: a name ``_x`` defined in module A is used only
inside A. A name that another module needs is public (no underscore) in the module that defines it.

What counts as a use, read from the source of ``mcore_ckpt_fixes/``, ``tests/``, ``tools/`` and
``benchmarks/`` with ``ast`` (function-level imports count too):

* ``from A import _x`` (relative or absolute), and ``A._x`` where ``A`` is bound to a module of the
  repository by ``import A.B [as C]``, ``from P import A [as C]`` or ``importlib.import_module("A")``
  (attribute chains such as ``mcore_ckpt_fixes.x.y._z`` included);
* ``C._x`` where ``C`` is a name imported from another module (a class's or an object's underscore
  attribute);
* ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` / ``monkeypatch.setattr`` /
  ``mock.patch.object``-shaped calls ``f(A, "_x", ...)``, and ``"module:_x"`` or ``"A._x"`` strings
  naming a module of the repository (``f"{__name__}..."`` and ``f"{__package__}..."`` resolved);
* ``f()._x`` and ``m = f(); m._x`` where the function ``f`` of the same file returns a module, and
  ``fixture._x`` where the function (a fixture) ``fixture`` loads a file of the repository with
  ``spec_from_file_location`` (``tools/docs.py``);
* the same in a string that parses as a script with imports (the code tests run in a subprocess:
  ``check_py(code)``), except this file's own strings (the trees its self-test scans).

Modules of ``tests/``, ``tools/`` and ``benchmarks/`` are found as they import each other: by their
folder on ``sys.path`` (``from conftest import ...``). Not seen: an attribute of an object reached
at run time (``self._x`` of an object built elsewhere, a module passed as an argument).

Private modules: a module whose name starts with an underscore is imported only by modules of its
own package (and its subpackages), with one exception: the stand-ins of
``mcore_ckpt_fixes/testing/`` (``_cpu_shims``, ``_standins``, ``_rng_standin``, ``_fused_adam``,
``_interrupt``: they change other packages' globals, so nothing in a user's job may import them) may
also be imported, with ``from mcore_ckpt_fixes.testing import _cpu_shims`` or
``from mcore_ckpt_fixes.testing._standins import install_mamba_ssm_stand_in``, by the code that
runs only in test, selftest and benchmark processes, the worlds' entry points: ``TEST_ONLY`` below
(each fix's ``checks/``, ``resume/``, ``tests/``, ``tools/``, ``benchmarks/``). Never by the engine,
a fix's declaration, ``runtime/`` or ``diff/``, the doctor or the CLI. Their own underscore members
(``_cpu_shims._x``) follow the rule like any other module's.

Exceptions, each a use of or from a fix's ``runtime/``, kept for good (``test_exceptions_are_not_stale``
checks each is still a use and still has its reason):

* ``CARRIED_BY_DIFFS``: the runtime's helper is text the source diffs carry verbatim into
  Megatron's own module (``patches/<fix>/*.patch``, generated from it and committed): its name is in
  those patches, and a rename would change them. Another runtime module of the fix, or a test of the
  helper, uses it under that name.
* ``FRAMEWORK_NAMES``: a replacement keeps the name of the framework's private function it stands
  for (fsdp-dtensor-pp-guard's ``_load_checkpoint_from_path`` on Megatron-Bridge), and a test checks
  the framework binds it.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import os
import re
import textwrap
from dataclasses import dataclass

from conftest import ROOT

TOPS = ("mcore_ckpt_fixes", "tests", "tools", "benchmarks")
SELF = "tests/test_private_names.py"
STAND_INS = "mcore_ckpt_fixes/testing/"
TEST_ONLY = (
    "mcore_ckpt_fixes/testing/*",
    "mcore_ckpt_fixes/fixes/*/checks/*",
    "mcore_ckpt_fixes/resume/*",
    "tests/*",
    "tools/*",
    "benchmarks/*",
)

# Permanent exceptions: (using file, name) -> why the name keeps its underscore. Each involves a fix's
# runtime/ and is tested to still hold (test_exceptions_are_not_stale).
RUNTIME = "mcore_ckpt_fixes/fixes/{}/runtime/{}.py"
TESTS = "tests/fixes/test_{}.py"
# The runtime's helper is text a committed source diff carries verbatim (patches/<fix>/*.patch are
# generated from the runtime's replacement sections and checked byte for byte; in Megatron's own
# module the helper is private): renaming it would change the committed diffs. (using file, name) ->
# the fix's folder under patches/, whose diffs must still hold the name.
CARRIED_BY_DIFFS: dict[tuple[str, str], str] = {
    (RUNTIME.format("dtensor_placement", "core"), "_dtensor_shard_for_checkpoint"): "dtensor-placement",
    (RUNTIME.format("expert_keys", "old_layouts"), "_ep_size_and_rank"): "expert-keys",
    (RUNTIME.format("mimo_optimizer", "core"), "_extract_common_state"): "mimo-optimizer",
    (RUNTIME.format("mimo_optimizer", "core"), "_restore_common_state"): "mimo-optimizer",
    (RUNTIME.format("mimo_optimizer", "core"), "_mimo_sharded_leaves"): "mimo-optimizer",
    (TESTS.format("chained_optim_main_params_split"), "_state_dicts_by_own_chunks"): "chained-optim-main-params-split",
    (TESTS.format("dp_reshardable_padding"), "_pad_to_unpadded_bucket_ends"): "dp-reshardable-padding",
    (TESTS.format("fsdp2_swiglu_split"), "_swiglu_factory_for_dtensor_shard"): "fsdp2-swiglu-split",
    (TESTS.format("fsdp_dtensor_pp_guard"), "_refuse_fsdp_dtensor_pipeline_change"): "fsdp-dtensor-pp-guard",
    (TESTS.format("hybrid_optimizer_common_state"), "_allowing_optimizer_classes"): "hybrid-optimizer-common-state",
    (TESTS.format("load_main_params_substring_match"), "_state_dict_keys_naming"): "load-main-params-substring-match",
    (TESTS.format("param_group_identity"), "_param_group_identifier_keys_for"): "param-group-identity",
    (TESTS.format("strictness_return_keys"), "_state_dict_alone"): "strictness-return-keys",
    (TESTS.format("model_load_fallback"), "_dropped_model_weights"): "model-load-fallback",
    (TESTS.format("factory_merges_non_strict"), "_factories_loaded"): "factory-merges-non-strict",
    ("tests/frameworks/test_bridge_pp_guard.py", "_refuse_fsdp_dtensor_pipeline_change"): "fsdp-dtensor-pp-guard",
}
# The runtime's replacement keeps the name of the framework's private function it stands for (a
# layer is bound where the framework binds that name; the test checks it is): (using file, name) ->
# why. The defining runtime module must still name the framework's attribute (the string).
FRAMEWORK_NAMES: dict[tuple[str, str], str] = {
    ("tests/frameworks/test_bridge_pp_guard.py", "_load_checkpoint_from_path"): (
        "fsdp-dtensor-pp-guard's layer on Megatron-Bridge's private _load_checkpoint_from_path keeps its name"
        " (setup.py binds it by that name); the test checks both bindings hold the replacement"
    ),
}
EXCEPTIONS = {**CARRIED_BY_DIFFS, **FRAMEWORK_NAMES}

ATTRIBUTE_CALLS = {"getattr", "setattr", "hasattr", "delattr", "object"}
SPEC = re.compile(r"^[A-Za-z_][\w.]*(:[\w.]+)?$")


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Use:
    path: str  # the using file, relative to the root
    line: int
    name: str  # the underscore name, or Owner._name for an imported object's attribute
    module: str  # the module (or package, for a private module) that defines it

    def __str__(self):
        return f"{self.path}:{self.line}: {self.name} (defined in {self.module})"


class Tree:
    """The modules under ``root``'s ``tops``, located as Python would import them."""

    def __init__(self, root: str, tops=TOPS):
        self.root, self.tops, self.cache = root, tops, {}
        self.paths = []  # every .py file, relative to root
        self.folders = [root]  # where top-level modules are found: root, then non-package folders
        for top in tops:
            for folder, dirs, files in os.walk(os.path.join(root, top)):
                dirs[:] = sorted(d for d in dirs if d != "__pycache__")
                self.paths += [
                    os.path.relpath(os.path.join(folder, f), root) for f in sorted(files) if f.endswith(".py")
                ]
                if not os.path.exists(os.path.join(root, top, "__init__.py")):
                    self.folders.append(folder)

    def locate(self, base: str, parts: list):
        """The module ``parts`` under folder ``base``: a file, a package's __init__.py, or a
        namespace folder (one holding Python files), relative to root; else None."""
        key = (base, tuple(parts))
        if key not in self.cache:
            self.cache[key] = self.located(base, parts)
        return self.cache[key]

    def located(self, base: str, parts: list):
        path = os.path.join(base, *parts)
        for candidate in (path + ".py", os.path.join(path, "__init__.py")):
            if parts and os.path.isfile(candidate):
                return os.path.relpath(candidate, self.root)
        if parts and os.path.isdir(path) and any(n.endswith(".py") for n in os.listdir(path)):
            return os.path.relpath(path, self.root)
        return None

    def find(self, dotted: str, importer: str):
        """An absolute import: a script's own folder first (not a package's: no implicit relative
        imports), then root and the folders of tests/, tools/ and benchmarks/."""
        own = os.path.dirname(os.path.join(self.root, importer))
        first = [] if os.path.exists(os.path.join(own, "__init__.py")) else [own]
        for base in first + self.folders:
            found = self.locate(base, dotted.split("."))
            if found:
                return found
        return None

    def relative(self, importer: str, level: int, dotted):
        base = os.path.dirname(os.path.join(self.root, importer))
        for _ in range(level - 1):
            base = os.path.dirname(base)
        if dotted:
            return self.locate(base, dotted.split("."))
        init = os.path.join(base, "__init__.py")
        return os.path.relpath(init if os.path.exists(init) else base, self.root)

    def child(self, module: str, name: str):
        """``module``'s submodule ``name``, for a package or namespace folder; else None."""
        folder = module[: -len("/__init__.py")] if module.endswith("__init__.py") else module
        if folder.endswith(".py"):
            return None
        return self.locate(os.path.join(self.root, folder), [name])


def dotted(module: str) -> str:
    name = module[: -len(".py")] if module.endswith(".py") else module
    return name[: -len("/__init__")].replace("/", ".") if name.endswith("/__init__") else name.replace("/", ".")


def private_module_allowed(importer: str, module: str, private_part: int) -> bool:
    """``module`` (a path) has a private part at index ``private_part``: its package, or, for the
    testing stand-ins, code that runs only in test and selftest worlds, may import it."""
    package = "/".join(module.split("/")[:private_part]) + "/"
    if importer.startswith(package):
        return True
    return package == STAND_INS and any(fnmatch.fnmatch(importer, p) for p in TEST_ONLY)


class FileScan:
    """The underscore names one file uses from other modules (and the Python code in its strings
    that parses as a script with imports: what tests run in a subprocess)."""

    def __init__(self, tree: Tree, path: str, source=None, offset: int = 0):
        self.tree, self.path, self.offset = tree, path, offset
        self.uses, self.bindings, self.returns = [], {}, {}
        if source is None:
            with open(os.path.join(tree.root, path), encoding="utf-8") as f:
                source = ast.parse(f.read(), path)
        self.source = source
        self.package = dotted(path) if path.endswith("__init__.py") else dotted(path).rpartition(".")[0]
        self.module = dotted(path)

    def run(self):
        for node in ast.walk(self.source):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self.bind(node)
        self.assigned = {
            n.targets[0].id: n.value
            for n in ast.walk(self.source)
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
        }
        for node in ast.walk(self.source):  # a function that returns a module: _mimo() -> core
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                returned = {self.evaluate(r.value) for r in ast.walk(node) if isinstance(r, ast.Return)}
                if len(returned) == 1 and next(iter(returned)) and next(iter(returned))[0] == "module":
                    self.returns[node.name] = returned.pop()
                loaded = self.loaded_by_path(node)
                if loaded:  # a fixture: the test functions name it as a parameter
                    self.bindings[node.name] = ("module", loaded)
        for node in ast.walk(self.source):  # rt = _mimo(), m = importlib.import_module("...")
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                target = self.evaluate(node.value) if isinstance(node.value, ast.Call) else None
                if target and target[0] == "module":
                    self.bindings[node.targets[0].id] = target
        self.pieces = {id(v) for n in ast.walk(self.source) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(self.source):
            self.check(node)
        return self.uses

    def loaded_by_path(self, function):
        """The module of the tree that ``function`` loads by file path
        (``spec_from_file_location(name, os.path.join(ROOT, "tools", "docs.py"))``), or None."""
        for call in ast.walk(function):
            func = getattr(call, "func", None)
            if (
                isinstance(call, ast.Call)
                and getattr(func, "attr", getattr(func, "id", None)) == "spec_from_file_location"
            ):
                parts, seen = [], set()
                for node in ast.walk(call.args[1]) if len(call.args) > 1 else ():
                    if isinstance(node, ast.Name) and node.id in self.assigned and node.id not in seen:
                        seen.add(node.id)
                        parts += [c.value for c in ast.walk(self.assigned[node.id]) if isinstance(c, ast.Constant)]
                    elif isinstance(node, ast.Constant):
                        parts.append(node.value)
                path = "/".join(p for p in parts if isinstance(p, str))
                return path if path in self.tree.paths else None
        return None

    def use(self, node, name: str, module: str):
        if module != self.path:
            self.uses.append(Use(self.path, self.offset + node.lineno, name, dotted(module)))

    def snippet(self, node, text: str):
        """A string that is a script with imports (``check_py(\"\"\"...\"\"\")``): scanned on its own
        (not this file's: its strings are the trees the scan's own test is run on)."""
        if self.path == SELF:
            return
        try:
            source = ast.parse(textwrap.dedent(text))
        except (SyntaxError, ValueError):
            return
        self.uses += FileScan(self.tree, self.path, source, self.offset + node.lineno - 1).run()

    def module_import(self, node, module: str):
        """An import of ``module``: a private part of its path must be allowed here."""
        parts = module.split("/")
        for i, part in enumerate(parts):
            stem = part[: -len(".py")] if part.endswith(".py") else part
            if private(stem) and not private_module_allowed(self.path, module, i):
                self.use(node, stem, "/".join(parts[:i]) + "/__init__.py")
                return

    def bind(self, node):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = self.tree.find(alias.name, self.path)
                if module:
                    self.module_import(node, module)
                    head = alias.name if alias.asname else alias.name.split(".")[0]
                    self.bindings[alias.asname or head] = ("module", self.tree.find(head, self.path))
            return
        if node.level:
            module = self.tree.relative(self.path, node.level, node.module)
        else:
            module = self.tree.find(node.module, self.path)
        if not module:
            return
        self.module_import(node, module)
        for alias in node.names:
            sub = self.tree.child(module, alias.name)
            if sub:
                self.module_import(node, sub)
                self.bindings[alias.asname or alias.name] = ("module", sub)
                continue
            if private(alias.name):
                self.use(node, alias.name, module)
            self.bindings[alias.asname or alias.name] = ("member", module, alias.name)

    def evaluate(self, node):
        """What an expression names: ("module", path), ("member", path, name) or None."""
        if isinstance(node, ast.Name):
            return self.bindings.get(node.id)
        if isinstance(node, ast.Attribute):
            owner = self.evaluate(node.value)
            if owner and owner[0] == "module":
                sub = self.tree.child(owner[1], node.attr)
                return ("module", sub) if sub else ("member", owner[1], node.attr)
            return None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.returns:
            return self.returns[node.func.id]
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if func == "import_module" and isinstance(node.args[0].value, str):
                module = self.tree.find(node.args[0].value, self.path)
                return ("module", module) if module else None
        return None

    def attribute(self, node, owner, name: str):
        """``owner.name`` is used at ``node``: ``owner`` as ``evaluate`` returns it."""
        if not owner or not private(name):
            return
        if owner[0] == "member":
            self.use(node, f"{owner[2]}.{name}", owner[1])
            return
        sub = self.tree.child(owner[1], name)
        if sub:
            self.module_import(node, sub)
        else:
            self.use(node, name, owner[1])

    def check(self, node):
        if isinstance(node, ast.Attribute):
            self.attribute(node, self.evaluate(node.value), node.attr)
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            name = node.args[1]
            if func in ATTRIBUTE_CALLS and isinstance(name, ast.Constant) and isinstance(name.value, str):
                self.attribute(node, self.evaluate(node.args[0]), name.value)
        elif isinstance(node, (ast.Constant, ast.JoinedStr)) and id(node) not in self.pieces:
            code, text = self.string(node, code=True), self.string(node)
            if code and "import " in code and "\n" in code:
                self.snippet(node, code)
            elif text and ("." in text or ":" in text) and SPEC.match(text):
                self.spec(node, text)

    def string(self, node, code: bool = False):
        """A string constant, or an f-string made of ``{__name__}`` / ``{__package__}`` and text
        (any other ``{...}`` stands for ``0`` where the string may be ``code``, else: None)."""
        if isinstance(node, ast.Constant):
            return node.value if isinstance(node.value, str) else None
        pieces = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                pieces.append(value.value)
            elif isinstance(value.value, ast.Name) and value.value.id in ("__name__", "__package__"):
                pieces.append(self.module if value.value.id == "__name__" else self.package)
            elif code:
                pieces.append("0")
            else:
                return None
        return "".join(pieces)

    def spec(self, node, text: str):
        """``"a.b.c"`` or ``"a.b:c"`` naming a module of the tree: each private part is a use."""
        module_name, _, attr = text.partition(":")
        parts = module_name.split(".")
        for i in range(len(parts), 0, -1):
            module = self.tree.find(".".join(parts[:i]), self.path)
            if module and module.startswith(tuple(top + "/" for top in self.tree.tops)):
                self.module_import(node, module)
                owner = ("module", module)
                for name in parts[i:] + ([attr.split(".")[0]] if attr else []):
                    self.attribute(node, owner, name)
                    owner = ("module", self.tree.child(owner[1], name)) if owner[0] == "module" else None
                    if not owner or not owner[1]:
                        break
                return


def scan(root: str = ROOT, tops=TOPS) -> list:
    """Every use of an underscore name from another module, in file and line order."""
    tree = Tree(root, tops)
    uses = {use for path in tree.paths for use in FileScan(tree, path).run()}
    return sorted(uses, key=lambda u: (u.path, u.line, u.name))


@functools.cache
def repository_uses() -> tuple:
    return tuple(scan())


def in_runtime(module: str) -> bool:
    """Is ``module`` (a path, or a dotted name) in a fix's runtime/?"""
    return fnmatch.fnmatch(module.replace(".", "/"), "mcore_ckpt_fixes/fixes/*/runtime/*")


def test_no_underscore_name_is_used_from_another_module():
    found = [u for u in repository_uses() if (u.path, u.name) not in EXCEPTIONS]
    assert not found, (
        "underscore names used outside the module that defines them (make the name public there,"
        " or test through the public API):\n" + "\n".join(map(str, found))
    )


def in_a_committed_patch(fix: str, name: str) -> bool:
    """Is ``name`` (as a word) in one of ``patches/<fix>/*.patch``?"""
    folder = os.path.join(ROOT, "patches", fix)
    word = re.compile(rf"(?<!\w){re.escape(name)}(?!\w)")
    for patch in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if patch.endswith(".patch"):
            with open(os.path.join(folder, patch), encoding="utf-8") as f:
                if word.search(f.read()):
                    return True
    return False


def names_as_string(module: str, name: str) -> bool:
    """Does ``module`` (dotted) hold the string ``name`` (the framework attribute it replaces)?"""
    with open(os.path.join(ROOT, *module.split(".")) + ".py", encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(tree))


def test_exceptions_are_not_stale():
    """Every exception is still a use of or from a fix's runtime/, for its reason still: a name
    carried by the diffs is still in that fix's committed patches; a framework's own private name is
    still the attribute the defining runtime module names."""
    assert not in_a_committed_patch("dtensor-placement", "_dtensor_shard")  # a word, not a part of one
    found = {(u.path, u.name): u for u in repository_uses()}
    stale = sorted(f"{path} {name}" for path, name in EXCEPTIONS if (path, name) not in found)
    assert not stale, "exceptions that are no longer uses (remove them): " + ", ".join(stale)
    outside = sorted(
        f"{path} {name}" for path, name in EXCEPTIONS if not (in_runtime(path) or in_runtime(found[path, name].module))
    )
    assert not outside, "exceptions may only hold uses of or from a fix's runtime/: " + ", ".join(outside)
    uncarried = sorted(
        f"{path} {name} (patches/{fix})"
        for (path, name), fix in CARRIED_BY_DIFFS.items()
        if not in_a_committed_patch(fix, name)
    )
    assert not uncarried, "no committed patch carries these names any more (rename them): " + ", ".join(uncarried)
    unnamed = sorted(
        f"{path} {name}" for path, name in FRAMEWORK_NAMES if not names_as_string(found[path, name].module, name)
    )
    assert not unnamed, "the runtime no longer names the framework's attribute: " + ", ".join(unnamed)


def write(root, files: dict):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_scan_sees_a_violation_and_passes_a_clean_tree(tmp_path):
    """The scan itself: each way of reaching another module's underscore name, and clean code."""
    package = {
        "mcore_ckpt_fixes/__init__.py": "",
        "mcore_ckpt_fixes/a/__init__.py": "",
        "mcore_ckpt_fixes/a/core.py": "_hidden = 1\nshown = 2\n\n\ndef _own():\n    return _hidden\n",
        "mcore_ckpt_fixes/testing/__init__.py": "",
        "mcore_ckpt_fixes/testing/_shim.py": "_inner = 1\nouter = 2\n",
        "mcore_ckpt_fixes/testing/launcher.py": "from . import _shim\n\nx = _shim.outer\n",
    }
    clean = {
        "mcore_ckpt_fixes/a/user.py": "from .core import shown\nfrom . import core\n\nx = core.shown + shown\n",
        "tests/helpers.py": "def helper():\n    return 1\n",
        "tests/test_a.py": "from helpers import helper\nfrom mcore_ckpt_fixes.testing._shim import outer\n",
    }
    write(tmp_path, {**package, **clean})
    assert scan(str(tmp_path)) == []
    violating = {
        "mcore_ckpt_fixes/a/bad.py": "from .core import _hidden\n",
        "mcore_ckpt_fixes/engine.py": "from mcore_ckpt_fixes.testing import _shim\n",
        "tests/helpers.py": "def _helper():\n    return 1\n",
        "tests/test_a.py": (
            "import mcore_ckpt_fixes.a.core as c\nimport mcore_ckpt_fixes.a.core\nfrom mcore_ckpt_fixes import a\n"
            "from mcore_ckpt_fixes.testing import _shim\nfrom helpers import _helper\n"
            "x = (c._own, mcore_ckpt_fixes.a.core._hidden, a.core._hidden, _shim._inner)\n"
            'y = getattr(c, "_hidden"), "mcore_ckpt_fixes.a.core:_own"\n'
            "def core_module():\n    from mcore_ckpt_fixes.a import core\n    return core\n"
            "z = core_module()._hidden\n"
            'check_py("import mcore_ckpt_fixes.a.core as m\\nm._own()\\n")\n'
        ),
        "tools/tool.py": "def _inner():\n    return 1\n",
        "tests/test_tool.py": (
            "import importlib.util, os\nROOT = os.path.dirname(__file__)\n"
            "def tool():\n    path = os.path.join(ROOT, 'tools', 'tool.py')\n"
            "    return importlib.util.spec_from_file_location('tool', path)\n"
            "def test_tool(tool):\n    assert tool._inner() == 1\n"
        ),
    }
    write(tmp_path, violating)
    assert [str(u) for u in scan(str(tmp_path))] == [
        "mcore_ckpt_fixes/a/bad.py:1: _hidden (defined in mcore_ckpt_fixes.a.core)",
        "mcore_ckpt_fixes/engine.py:1: _shim (defined in mcore_ckpt_fixes.testing)",
        "tests/test_a.py:5: _helper (defined in tests.helpers)",
        "tests/test_a.py:6: _hidden (defined in mcore_ckpt_fixes.a.core)",
        "tests/test_a.py:6: _inner (defined in mcore_ckpt_fixes.testing._shim)",
        "tests/test_a.py:6: _own (defined in mcore_ckpt_fixes.a.core)",
        "tests/test_a.py:7: _hidden (defined in mcore_ckpt_fixes.a.core)",
        "tests/test_a.py:7: _own (defined in mcore_ckpt_fixes.a.core)",
        "tests/test_a.py:11: _hidden (defined in mcore_ckpt_fixes.a.core)",
        "tests/test_a.py:13: _own (defined in mcore_ckpt_fixes.a.core)",
        "tests/test_tool.py:7: _inner (defined in tools.tool)",
    ]
