"""What every fix inherits, checked for every shipped fix (``fixes.ORDER``) and each of its targets in
one place; tests/fixes/test_<fix>.py keep only what is specific to each bug.

* Registry: the round trips each fix declares (``checks/scenarios.py``) are well-formed, and every
  published release in its affected range has one that shows the bug.
* Flags: ``MCORE_CKPT_FIX_<ID>=off`` says disabled, naming the variable; ``MCORE_CKPT_FIXES=<id>``
  enables that fix alone (tests/engine/test_flags.py tests the parsing, on two fixes).
* Probe verdicts, per target whose module imports on this line: ``(verdict, reason)`` with the
  verdict in (True, False, None); True only inside the declared range, True wherever the range holds
  the release and the feature is there; the engine's state agrees; the same answer with every fix
  applied (a probe judges the release's code). A target module this release lacks: not-applicable.
  Where the probe finds the bug, a round trip can show it here.
* Unknown code left alone: each probe on an empty stand-in module, through the engine, leaves it
  not-applicable; on the release's module with what the fix replaces reworked (another signature
  that raises) it says None or raises, never True. Why both are safe: None is the engine's
  not-applicable, and a probe that raises is left alone, never failed
  (tests/engine/test_moved_internals.py: test_engine_leaves_code_alone_when_a_probe_raises, and a
  whole checkout whose helper moved).
* Revert and lifecycle: tests/engine/test_lifecycle.py (every fix, both import orders, a ``spawn``
  child, revert to the exact objects) and tests/engine/test_all_fixes.py (every fix at once, layers).

The flags, probes and stand-ins run in one fresh interpreter for every fix (CHILD, about 10 s); each
fix's and target's result is its own test. Findings this file made are kept as strict xfails (each
fails the run once its cause is fixed, so that it is taken out of these lists).
"""

from __future__ import annotations

import importlib
import json
import os

import pytest
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from conftest import ROOT, run_py
from mcore_ckpt_fixes.engine.flags import env_var_for
from mcore_ckpt_fixes.engine.registry import ENGINE
from mcore_ckpt_fixes.engine.version import detect
from mcore_ckpt_fixes.fixes import ORDER
from mcore_ckpt_fixes.testing import Bug, Scenario, for_fix, resolve

FIXES = ENGINE.discover()
VERSION = detect().version  # this line's Megatron-Core (None where it is not installed)
# Every published Megatron-Core release the fixes' ranges span (the sweep's list).
with open(os.path.join(ROOT, "tools", "sweep-releases.txt")) as _f:
    RELEASES = [Version(line.split()[0]) for line in _f if line.strip() and not line.startswith("#")]

# -- findings (reported; the fixes' runtimes are not this file's to change) -------------------------
# Each: (the releases where it shows, why). The releases are where the fix applies and the probe
# then sees its own replacement, or where apply replaces code the probe did not judge.
#
# Probes that judge what is in the module now, not the release's object (``original``): once the fix
# is applied they judge its own replacement. The engine's states stay right (it probes a target
# before applying to it), but a probe must judge the release's code whenever it is called.
PROBE_READS_THE_FIX: dict = {}  # none left: each probe runs original(...) of what its fix replaces
# Probes that judge other code than what their apply replaces: handed the release's module with that
# reworked (another signature that raises), they still say True, and apply would replace it.
REWORKED_STILL_PATCHED: dict = {}  # none left: each probe judges the code its apply replaces
# Affected releases on which no declared round trip shows the bug (selftest has nothing to run there).
UNSHOWN = {
    "dist-optim-mixed-dtype-order": (
        "affected from 0.12.0; its one scenario (equal_sizes) needs the fully_reshardable format (0.15.0 "
        "on) and declares the bug from 0.15.0: no round trip shows it on 0.12.0-0.14.0"
    ),
}


def _fix_params(known=None):
    return [
        pytest.param(f, id=f, marks=[pytest.mark.xfail(reason=known[f], strict=True)] if known and f in known else [])
        for f in ORDER
    ]


def _target_params(known=None):
    """(fix id, module) of every target of every fix; a known finding as a strict xfail on the
    releases it shows on."""
    params = []
    for fix_id in ORDER:
        for target in FIXES[fix_id].targets:
            key = (fix_id, target.module)
            marks = []
            if known and key in known:
                shows = VERSION is not None and VERSION in SpecifierSet(known[key][0])
                marks = [pytest.mark.xfail(shows, reason=known[key][1], strict=True)]
            params.append(pytest.param(fix_id, target.module, id=f"{fix_id}/{target.module}", marks=marks))
    return params


def _target(fix_id, module):
    return next(t for t in FIXES[fix_id].targets if t.module == module)


# -- registry --------------------------------------------------------------------------------------


def _own_function(fix, ref, what):
    """``ref`` names a callable of ``fix``'s own checks package."""
    module, _, attr = ref.partition(":")
    assert module.startswith(f"{fix.home}.checks.") and attr, f"{what} {ref!r} is not in {fix.home}.checks"
    assert callable(resolve(ref)), f"{what} {ref!r} is not callable"


def _well_formed_bug(bug, where):
    assert isinstance(bug, Bug), (where, bug)
    assert bug.kind in ("raises", "wrong-values"), (where, bug.kind)
    if bug.kind == "raises":
        assert isinstance(bug.phase, str) and bug.phase, (where, bug.phase)
        assert isinstance(bug.error, str) and bug.error, (where, bug.error)


def _check_scenario(fix, s):
    assert isinstance(s, Scenario) and s.fix_id == fix.id, (fix.id, s)
    assert isinstance(s.name, str) and s.name, s
    _own_function(fix, s.func, f"{s.id}: func")
    for what in ("prepare", "batch", "applicable"):
        if getattr(s, what) is not None:
            _own_function(fix, getattr(s, what), f"{s.id}: {what}")
    assert type(s.nproc) is int and s.nproc > 0, (s.id, s.nproc)
    assert s.devices and set(s.devices) <= {"cpu", "cuda"}, (s.id, s.devices)
    assert s.timeout > 0, (s.id, s.timeout)
    for ref in s.requires:  # "module:attribute" (the attribute may be dotted)
        module, _, attr = ref.partition(":")
        assert module and attr, (s.id, ref)
    assert all(a in ORDER and a != fix.id for a in s.alongside), (s.id, s.alongside)
    if isinstance(s.bug, dict):
        assert s.bug, s.id
        for spec, bug in s.bug.items():
            try:
                SpecifierSet(spec)
            except InvalidSpecifier:
                pytest.fail(f"{s.id}: {spec!r} is not a PEP 440 specifier set")
            _well_formed_bug(bug, f"{s.id} {spec}")
    else:
        _well_formed_bug(s.bug, s.id)


@pytest.mark.parametrize("fix_id", _fix_params())
def test_registry(fix_id):
    """The fix's round trips are the ones its package declares, each well-formed, names unique."""
    fix = FIXES[fix_id]
    assert fix.home == f"mcore_ckpt_fixes.fixes.{fix_id.replace('-', '_')}", fix.home
    declared = tuple(importlib.import_module(f"{fix.home}.checks.scenarios").SCENARIOS)
    assert for_fix(fix_id) == declared  # each names this fix; none declared elsewhere names it
    if fix.implemented:
        assert declared, f"{fix_id} declares no round trip"
    names = [s.name for s in declared]
    assert len(set(names)) == len(names), names
    for s in declared:
        _check_scenario(fix, s)


@pytest.mark.parametrize("fix_id", _fix_params(UNSHOWN))
def test_every_affected_release_has_a_round_trip_that_shows_the_bug(fix_id):
    """On every published release in the fix's range, some scenario declares what the fix-off half
    shows there (a scenario may declare none on a release where both halves are exact)."""
    fix = FIXES[fix_id]
    if not fix.implemented:
        pytest.skip(f"{fix_id} is not implemented")
    scenarios = for_fix(fix_id)
    unshown = [str(r) for r in RELEASES if r in fix.specifiers and not any(s.bug_for(r) for s in scenarios)]
    assert not unshown, f"{fix_id} ({fix.affected}): no scenario declares the bug on {unshown}"


# -- one interpreter for the flags, the probes and the stand-ins of every fix ----------------------

CHILD = r'''
import contextlib, importlib, json, os, sys, types, warnings

import mcore_ckpt_fixes  # every MCORE_CKPT_FIX_<ID>=off: nothing applied, nothing waits
from mcore_ckpt_fixes.cli.status import import_targets
from mcore_ckpt_fixes.engine.fix import Fix, Target
from mcore_ckpt_fixes.engine.flags import GLOBAL_VAR, PER_FIX_PREFIX
from mcore_ckpt_fixes.engine.registry import ENGINE
from mcore_ckpt_fixes.engine.version import detect, package_version
from mcore_ckpt_fixes.fixes import ORDER
from mcore_ckpt_fixes.testing import for_fix
from mcore_ckpt_fixes.testing._standins import install_mamba_ssm_stand_in

out = {"targets": {}, "scenarios": {}}


def rows():
    return {r["id"]: r for r in mcore_ckpt_fixes.report()}


def quiet(call, *args):
    with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call(*args)


def called(probe, module):
    """What probe(module) gave: its verdict and reason, what it raised, or what else it returned."""
    try:
        result = quiet(probe, module)
    except Exception as exc:
        return {"raised": f"{type(exc).__name__}: {exc}"[:300]}
    if isinstance(result, tuple) and len(result) == 2 and any(result[0] is v for v in (True, False, None)):
        return {"verdict": result[0], "reason": result[1] if isinstance(result[1], str) else repr(result[1])}
    return {"malformed": repr(result)[:300]}


# Flags: each fix's own variable off (this interpreter's environment), then MCORE_CKPT_FIXES naming
# one fix at a time.
out["all_off"] = {i: [r["state"], r["reason"]] for i, r in rows().items()}
for var in [v for v in os.environ if v.startswith(PER_FIX_PREFIX)]:
    del os.environ[var]
out["only"] = {}
for fix_id in ORDER:
    os.environ[GLOBAL_VAR] = fix_id
    mcore_ckpt_fixes.apply()
    out["only"][fix_id] = {i: [r["mode"], r["state"]] for i, r in rows().items() if r["mode"] != "off" or r["state"] != "disabled"}
os.environ[GLOBAL_VAR] = "off"
mcore_ckpt_fixes.apply()

# Probes on the release's code (every fix off), then with every fix applied.
install_mamba_ssm_stand_in()
targets = [(fix, t) for fix in ENGINE.discover().values() for t in fix.targets]
modules = {}
for fix, t in targets:
    key = f"{fix.id}|{t.module}"
    version = detect().version if t.gated_by_megatron else package_version(t.package)
    try:
        modules[key] = quiet(importlib.import_module, t.module)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    out["targets"][key] = {"version": str(version) if version else None, "import_error": error}
    if error is None:
        out["targets"][key]["before"] = called(t.probe, modules[key])
del os.environ[GLOBAL_VAR]
mcore_ckpt_fixes.apply()
for fix, t in targets:
    key = f"{fix.id}|{t.module}"
    if key in modules:
        out["targets"][key]["after"] = called(t.probe, modules[key])
import_targets()  # as `status` does: a target module that does not import is decided not-applicable
for fix_id, row in rows().items():
    for module_name, state in row["targets"].items():
        out["targets"][f"{fix_id}|{module_name}"]["engine"] = [state["state"], state["reason"]]
version = detect().version
for fix in ENGINE.discover().values():
    out["scenarios"][fix.id] = {s.name: [quiet(s.absent), s.bug_for(version) is not None] for s in for_fix(fix.id)}
changes = {fix.id: [(r.owner, r.name) for r in ENGINE.changes(fix.id)] for fix in ENGINE.discover().values()}

# Each probe through the engine, on an empty stand-in module (a copy of the target, nothing else).
applied = []


def never(module, patcher):
    applied.append(module.__name__)
    raise AssertionError(f"{module.__name__} applied")


stand_ins = {}
for n, (fix, t) in enumerate(targets):
    name = f"mcore_ckpt_fixes_stand_in_{n}"
    sys.modules[name] = types.ModuleType(name)
    stand_ins[f"stand-in-{n}"] = (f"{fix.id}|{t.module}", name)
    ENGINE.register(Fix(id=f"stand-in-{n}", summary="stand-in", affected=">=0", targets=(Target(name, t.probe, never),)))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    mcore_ckpt_fixes.apply()
report = rows()
for fix_id, (key, name) in stand_ins.items():
    state = report[fix_id]["targets"][name]
    warned = [str(w.message) for w in caught if fix_id in str(w.message)]
    out["targets"][key]["stand_in"] = [state["state"], state["reason"], warned, name in applied]

# The release's module with what the fix replaces there (in it or in a class of it) reworked.
mcore_ckpt_fixes.revert()


def reworked(*args, **kwargs):
    raise TypeError("reworked upstream: another signature")


for n, (fix, t) in enumerate(targets):
    key = f"{fix.id}|{t.module}"
    module = modules.get(key)
    if module is None:
        continue
    stand_in = types.ModuleType(f"mcore_ckpt_fixes_reworked_{n}")
    skip = ("__name__", "__spec__", "__loader__")
    stand_in.__dict__.update({k: v for k, v in module.__dict__.items() if k not in skip})
    names, classes = [], {}
    for owner, name in changes[fix.id]:
        if owner is module:
            setattr(stand_in, name, reworked)
            names.append(name)
        for attr, value in module.__dict__.items():
            if isinstance(owner, type) and value is owner:
                classes.setdefault(attr, (owner, set()))[1].add(name)
    for attr, (cls, methods) in classes.items():
        setattr(stand_in, attr, type(cls.__name__, (cls,), dict.fromkeys(methods, reworked)))
        names += [f"{attr}.{m}" for m in methods]
    if names:
        out["targets"][key]["reworked"] = [sorted(names), called(t.probe, stand_in)]
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def every_fix(mcore_version):
    """The child's findings (one fresh interpreter for every fix: each fix's own variable off at
    its start, as a user's environment switches it off)."""
    proc = run_py(CHILD, {env_var_for(fix_id): "off" for fix_id in ORDER})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[0][7:])


# -- flags -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fix_id", _fix_params())
def test_flags(fix_id, every_fix):
    """Its own variable off: disabled, the reason naming the variable. ``MCORE_CKPT_FIXES`` naming
    it: it alone is on (``auto``), every other fix disabled."""
    var = env_var_for(fix_id)
    assert var == "MCORE_CKPT_FIX_" + fix_id.upper().replace("-", "_")
    state, reason = every_fix["all_off"][fix_id]
    assert state == "disabled" and var in reason, (var, state, reason)
    alone = every_fix["only"][fix_id]  # MCORE_CKPT_FIXES=<fix id>: every fix but this one off
    assert list(alone) == [fix_id] and alone[fix_id][0] == "auto" and alone[fix_id][1] != "disabled", alone


# -- probe verdicts --------------------------------------------------------------------------------


def _feature_absent(fix_id, every_fix) -> bool:
    """None of the fix's round trips can run here: the Megatron feature they exercise is absent."""
    scenarios = every_fix["scenarios"][fix_id]
    return bool(scenarios) and all(absent is not None for absent, _ in scenarios.values())


def _result(fix_id, module, every_fix):
    """This target's findings, or a skip (not implemented; a framework that is not importable here,
    after checking that the engine reports it not-applicable)."""
    fix, target = FIXES[fix_id], _target(fix_id, module)
    if not fix.implemented:
        pytest.skip(f"{fix_id} is not implemented: nothing is probed")
    found = every_fix["targets"][f"{fix_id}|{module}"]
    if found["import_error"] and not target.gated_by_megatron:
        assert found["engine"][0] == "not-applicable", found["engine"]
        pytest.skip(
            f"{target.package} is not importable here ({found['import_error']}): its probe is tested on its "
            f"framework line (tools/test.sh fw-{target.package})"
        )
    return fix, target, found


@pytest.mark.parametrize("fix_id, module", _target_params())
def test_probe_verdict(fix_id, module, every_fix):
    """On the release's code: a verdict and a reason; True only inside the declared range and
    wherever the range holds this release and the feature is there; the engine's state agrees."""
    fix, target, found = _result(fix_id, module, every_fix)
    state, why = found["engine"]
    if found["import_error"]:  # this release has no such module
        assert state == "not-applicable" and f"cannot import {module}" in why, found
        return
    assert "verdict" in found["before"], found["before"]  # the release's own code: judged, never raised
    verdict, reason = found["before"]["verdict"], found["before"]["reason"]
    assert isinstance(reason, str) and reason.strip(), found["before"]
    # The version that gates the target: Megatron-Core's, or its framework's.
    in_range = found["version"] is not None and Version(found["version"]) in target.specifiers(fix)
    absent = _feature_absent(fix_id, every_fix)
    if in_range:
        assert verdict is True or (verdict is None and absent), (found["version"], fix.affected, verdict, reason)
        assert state == {True: "applied", None: "not-applicable"}[verdict], (state, why)
    else:
        assert verdict is not True, f"{module}: the bug found on {found['version']}, outside {fix.affected}: {reason}"
        # None ("the feature is absent") where the fix's round trips cannot run here either, or where
        # another of its targets judges the code (a fix over several modules: e.g. numpy2-product's
        # np.product gone from one module while another keeps the function).
        others = [
            t["before"].get("verdict")
            for key, t in every_fix["targets"].items()
            if key.startswith(f"{fix_id}|") and key != f"{fix_id}|{module}" and "before" in t
        ]
        assert verdict is False or absent or any(v is not None for v in others), (verdict, reason)
        assert state == "not-needed", (state, why)


@pytest.mark.parametrize("fix_id, module", _target_params(PROBE_READS_THE_FIX))
def test_probe_judges_the_release_code_after_apply(fix_id, module, every_fix):
    """Called again with every fix applied, a probe answers as on the release's code (it judges
    ``original(...)``, not the fix's replacement)."""
    _, _, found = _result(fix_id, module, every_fix)
    if found["import_error"]:
        pytest.skip(f"this release has no {module}")
    assert found["after"] == found["before"], found


@pytest.mark.parametrize("fix_id", _fix_params())
def test_a_round_trip_shows_what_the_probe_finds(fix_id, every_fix):
    """Where a probe finds the bug on a release in the fix's range, some round trip can run here and
    declares the bug for this release: selftest can show it."""
    fix = FIXES[fix_id]
    found = [
        every_fix["targets"][f"{fix_id}|{t.module}"].get("before", {}).get("verdict")
        for t in fix.targets
        if t.gated_by_megatron
    ]
    if not (fix.implemented and VERSION in fix.specifiers and True in found):
        pytest.skip(f"{fix_id} finds no bug to show on {VERSION}")
    shown = [n for n, (absent, declares) in every_fix["scenarios"][fix_id].items() if absent is None and declares]
    assert shown, every_fix["scenarios"][fix_id]


# -- unknown code left alone -----------------------------------------------------------------------


@pytest.mark.parametrize("fix_id, module", _target_params())
def test_empty_stand_in_is_left_alone(fix_id, module, every_fix):
    """The probe, registered through the engine on a module with none of the target's names: the
    engine decides not-applicable (the probe said None, with why, or raised and the code was left
    alone), never applies, never fails, never warns."""
    if not FIXES[fix_id].implemented:
        pytest.skip(f"{fix_id} is not implemented")
    state, reason, warned, applied = every_fix["targets"][f"{fix_id}|{module}"]["stand_in"]
    assert (state, warned, applied) == ("not-applicable", [], False), (state, reason, warned, applied)
    assert reason.strip(), reason


@pytest.mark.parametrize("fix_id, module", _target_params(REWORKED_STILL_PATCHED))
def test_reworked_code_is_left_alone(fix_id, module, every_fix):
    """The release's module with each attribute the fix replaces there swapped for a function of
    another signature that raises: the probe says None (with why) or raises (the engine then leaves
    the code alone). Not False (nothing says upstream fixed it), never True (apply would replace
    code the fix does not know)."""
    _, _, found = _result(fix_id, module, every_fix)
    if "reworked" not in found:
        pytest.skip(f"{fix_id} replaces nothing in {module} on {VERSION}: nothing to rework")
    names, outcome = found["reworked"]
    if "verdict" in outcome:
        assert outcome["verdict"] is None and outcome["reason"].strip(), (names, outcome)
    else:
        assert "raised" in outcome, (names, outcome)


# -- nothing left as the scaffold wrote it -----------------------------------------------------------

UNWRITTEN = "NOT WRITTEN YET"  # what tools/new_fix.py writes where the bug's own knowledge goes


def unwritten_files(root: str, fix_id: str) -> list:
    """The files of ``fix_id`` (its folder and its test) that still hold the scaffold's marker."""
    pkg = fix_id.replace("-", "_")
    paths = [os.path.join(root, "tests", "fixes", f"test_{pkg}.py")]
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "mcore_ckpt_fixes", "fixes", pkg)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        paths += [os.path.join(dirpath, name) for name in filenames]
    found = []
    for path in sorted(paths):
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                if UNWRITTEN in f.read():
                    found.append(os.path.relpath(path, root))
    return found


@pytest.mark.parametrize("fix_id", ORDER)
def test_nothing_left_unwritten(fix_id):
    """A fix started with tools/new_fix.py is done when no file of it says the scaffold's marker."""
    left = unwritten_files(ROOT, fix_id)
    assert not left, f"{fix_id}: still {UNWRITTEN!r} in " + ", ".join(left)
