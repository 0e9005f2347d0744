#!/usr/bin/env python3
"""Write the skeleton of a new fix: ``python tools/new_fix.py FIX_ID MODULE [--function NAME]``.

FIX_ID: lower case, words joined by ``-`` (``my-fix``); MODULE: the Megatron-Core module it patches
(``megatron.core.dist_checkpointing.validation``); NAME: the function there its layer wraps.

Writes, under ``mcore_ckpt_fixes/fixes/<fix>/``: the declaration (``__init__.py``), the runtime
(``runtime/core.py``: a ``@layer`` and the probe), the round trip (``checks/scenarios.py``,
``checks/core.py``), the page (``doc.md``), the catalogue entry (``bugs.json``); and the test
``tests/fixes/test_<fix>.py``. It adds the id at the end of ``fixes.ORDER`` and a line to the
CHANGELOG's Unreleased section. Every part that needs the bug's own knowledge says
``NOT WRITTEN YET``: ``tests/fixes/test_every_fix.py`` names each file that still does, and the
fix's two halves fail until they are written. A source diff, where the fix has one, is
``diff/core.py`` (CONTRIBUTING.md, "Adding a fix").

Exit 0: written; 2: bad input (one line), nothing written.
"""

from __future__ import annotations

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXES = os.path.join(ROOT, "mcore_ckpt_fixes", "fixes")
MARK = "NOT WRITTEN YET"

DECLARATION = '''"""{id}: {MARK}: what this fix keeps from breaking, in one line.

Affected: Megatron-Core {MARK} (upstream: {MARK}).

Failure prevented: {MARK}: what the user sees, on which call, and why.

How: {MARK}: one sentence. The rest is on the page, doc.md.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "{id}"
MODULE = "{module}"
FUNCTION = "{function}"

FIX = Fix(
    id=ID,
    summary="{MARK}",
    affected=">=0.0.0",  # {MARK}: the measured range, PEP 440
    upstream=("{MARK}",),
    targets=(Target(MODULE),),
)
'''

RUNTIME = '''"""{id} in a job: the layer on ``{module}.{function}`` and the probe. Why: doc.md."""

from __future__ import annotations

import types

from ....engine.layers import layer
from ....engine.patching import original
from .. import FUNCTION, ID, MODULE


@layer(ID, MODULE, FUNCTION)
def {function}(release, *args, **kwargs):
    """{MARK}: what changes around the release's own call (``release``: the layer below)."""
    return release(*args, **kwargs)


def probe(module: types.ModuleType):
    """(True, why) where the release's own code has the bug, (False, why) where it is fixed, (None,
    why) where the feature is absent; code it cannot judge raises or returns None, and is left alone."""
    if FUNCTION not in module.__dict__:
        return None, f"{{MODULE}} has no {{FUNCTION}}"
    fn = original(module, FUNCTION)  # the release's, whether the fix is in place or not
    raise NotImplementedError(f"{{ID}}: the probe is {MARK} (run {{fn.__qualname__}} on stand-ins)")
'''

SCENARIOS = '''"""{id}'s round trip as the suite and ``selftest`` find it (nothing heavy imported here)."""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{{__package__}}.core"
BUG = Bug.raises("load", "{MARK}: the release's own error line, as the unpatched half shows it")

SCENARIOS = (Scenario(ID, "round_trip", f"{{_CORE}}:round_trip", 2, BUG, prepare=f"{{_CORE}}:prepare", doc="{MARK}"),)
'''

CHECKS = '''"""{id}'s round trip on 2 gloo ranks: {MARK}: what is saved, what is loaded, what is compared."""

from __future__ import annotations

from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE


def prepare() -> None:
    """In the parent of a forked world: the modules the ranks use."""
    import {module}  # noqa: F401


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    rt = RoundTrip()
    with rt.running():
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt.phase("save")
        raise NotImplementedError(f"{{ID}}: the round trip is {MARK}")
    return rt.result
'''

PAGE = """**Affected Megatron-Core:** {MARK}. **Without it:** {MARK}: what breaks, in one line (the fix's row
in docs/fixes.md).

## What breaks

{MARK}: for whom, on which releases, with which error or which wrong values.

## What the fix does

{MARK}: and what a checkpoint saved without it holds, and how it loads.

## Source diffs

{MARK}: the files each diff edits (this paragraph is the fix's row in patches/README.md).
"""

TEST = '''"""{id}: both halves on every affected CI line (see checks/core.py)."""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.{pkg} import FIX
from mcore_ckpt_fixes.fixes.{pkg}.checks import scenarios as sc

CORE = "mcore_ckpt_fixes.fixes.{pkg}.checks.core"


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{{CORE}}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def test_unpatched_shows_the_documented_failure(worlds, mcore_version):
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False])
    pytest.fail("{MARK}: assert the release's failure on every rank")


def test_patched_round_trip_is_exact(worlds):
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
    pytest.fail("{MARK}: assert every saved value loads exactly on every rank")
'''

BUGS = {
    "bugs": [
        {
            "id": "{id}",
            "symptom": f"{MARK}: what the user sees",
            "affected": ">=0.0.0",
            "upstream": [f"{MARK}"],
            "status": "fixed",
            "silent": False,
        }
    ]
}


def _refuse(message: str) -> None:
    print(f"new_fix: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check(fix_id: str, module: str, function: str) -> str:
    if not re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", fix_id):
        _refuse(f"fix id {fix_id!r}: expected lower-case words joined by '-' (e.g. my-fix)")
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", module):
        _refuse(f"module {module!r}: expected a dotted module name (e.g. megatron.core.dist_checkpointing.validation)")
    if not function.isidentifier():
        _refuse(f"--function {function!r}: expected a Python identifier")
    pkg = fix_id.replace("-", "_")
    if os.path.exists(os.path.join(FIXES, pkg)):
        _refuse(f"fix {fix_id!r} exists already (mcore_ckpt_fixes/fixes/{pkg}/)")
    return pkg


def files(fix_id: str, module: str, function: str) -> dict:
    """{path under the repository: text} of the skeleton."""
    pkg = fix_id.replace("-", "_")
    values = {"id": fix_id, "pkg": pkg, "module": module, "function": function, "MARK": MARK}
    home = f"mcore_ckpt_fixes/fixes/{pkg}"
    bugs = json.dumps(BUGS, indent=2).replace('"{id}"', json.dumps(fix_id)) + "\n"
    return {
        f"{home}/__init__.py": DECLARATION.format(**values),
        f"{home}/runtime/core.py": RUNTIME.format(**values),
        f"{home}/checks/scenarios.py": SCENARIOS.format(**values),
        f"{home}/checks/core.py": CHECKS.format(**values),
        f"{home}/doc.md": PAGE.format(**values),
        f"{home}/bugs.json": bugs,
        f"tests/fixes/test_{pkg}.py": TEST.format(**values),
    }


def add_to_order(fix_id: str) -> None:
    path = os.path.join(FIXES, "__init__.py")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, sep, tail = text.rpartition("\n)")
    if not sep:
        _refuse("mcore_ckpt_fixes/fixes/__init__.py: ORDER's closing ')' not found")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f'{head}\n    "{fix_id}",{sep}{tail}')


def add_to_changelog(fix_id: str) -> None:
    path = os.path.join(ROOT, "CHANGELOG.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    line = f"- `{fix_id}`: {MARK}: what a user of the affected releases no longer meets.\n"
    start = text.find("## [Unreleased]")
    if start < 0:
        _refuse("CHANGELOG.md has no '## [Unreleased]' section")
    added = text.find("### Added\n", start)
    following = text.find("\n## [", start + 1)
    if added < 0 or (0 <= following < added):
        text = (
            text[: start + len("## [Unreleased]\n")]
            + f"\n### Added\n\n{line}"
            + text[start + len("## [Unreleased]\n") :]
        )
    else:
        # The first entry of the section, after the blank line that may follow the heading.
        at = added + len("### Added\n")
        if text.startswith("\n", at):
            at += 1
        text = text[:at] + line + text[at:]
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main(argv) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="tools/new_fix.py", description="Write the skeleton of a new fix.")
    parser.add_argument("fix_id")
    parser.add_argument("module")
    parser.add_argument("--function", default="function_to_wrap", help="the function of MODULE the layer wraps")
    args = parser.parse_args(argv)
    _check(args.fix_id, args.module, args.function)
    written = files(args.fix_id, args.module, args.function)
    for rel, text in written.items():
        path = os.path.join(ROOT, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    add_to_order(args.fix_id)
    add_to_changelog(args.fix_id)
    print(
        "\n".join(["wrote:"] + sorted(written) + ["edited: mcore_ckpt_fixes/fixes/__init__.py (ORDER), CHANGELOG.md"])
    )
    print(f"next: replace every '{MARK}' (tests/fixes/test_every_fix.py names the files that still say it)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
