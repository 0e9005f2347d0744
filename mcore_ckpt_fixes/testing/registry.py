"""The fixes' round-trip scenarios: how one is declared, and where the suite and ``selftest`` find them.

A scenario is a function ``(rank, world_size, ckpt_dir, patched, device="cpu") -> dict`` run on
every rank of a world started by :mod:`mcore_ckpt_fixes.testing.launcher`. It returns what a
:class:`mcore_ckpt_fixes.testing.result.RoundTrip` records: ``error`` (the first failure as
``"Type: message"``, ``None`` when the round trip completed), ``phase`` (where it happened),
``max_delta`` (the largest absolute difference per tensor between what was saved and what was
loaded), ``digests`` (per tensor: fingerprints of what was saved and what was loaded, part by part,
so that a world's judgement can tell whose values a rank loaded), ``n_tensors`` and ``fix_state``,
plus what the scenario adds.

Each fix declares its scenarios in ``mcore_ckpt_fixes/fixes/<fix>/checks/scenarios.py`` as a tuple
``SCENARIOS`` of :class:`Scenario`; :func:`for_fix` and :func:`all_scenarios` find them through the
engine's discovery, so adding a fix edits no shared list. A :class:`Scenario` says how to read the
fix-off half on a release the fix is needed for (its :class:`Bug`: the documented error, exactly,
or another rank's values after load). On a release that does not need the fix, both halves must
round-trip exactly.

This module imports nothing heavy (no torch, no megatron): ``selftest`` reads the declarations
before deciding what to run; scenario functions and ``prepare`` hooks are named as strings and
imported only when they run.
"""

from __future__ import annotations

import importlib
import math

__all__ = ["Bug", "Scenario", "all_scenarios", "for_fix", "resolve"]


class Bug:
    """What the fix-off half shows on a release that needs the fix.

    ``Bug.raises(phase, error)``: every rank stops in ``phase`` with exactly ``error``.
    ``Bug.wrong_values()``: the round trip completes but some rank loads another rank's values: every
    tensor it got wrong holds (part by part, e.g. per component of a fused tensor) exactly what
    another rank saved under the same key. Any other wrong value (one no rank saved, another shape:
    ``inf``, NaN) is another failure, not this bug.
    """

    __slots__ = ("kind", "phase", "error")

    def __init__(self, kind, phase=None, error=None):
        if kind not in ("raises", "wrong-values"):
            raise ValueError(f"unknown bug kind {kind!r}")
        self.kind, self.phase, self.error = kind, phase, error

    @classmethod
    def raises(cls, phase, error):
        return cls("raises", phase, error)

    @classmethod
    def wrong_values(cls):
        return cls("wrong-values")

    def describe(self) -> str:
        if self.kind == "raises":
            return f"{self.error} (in {self.phase})"
        return "a rank loads other values than it saved"

    def matches(self, result: dict) -> bool:
        """Does this rank's result show the bug, as far as one rank can tell? (``raises``: exactly
        this error in this phase; ``wrong-values``: the round trip got to the comparison and some
        tensor differs, every differing one by a finite amount; whose values they are takes the
        world: :meth:`seen_in`.)"""
        if self.kind == "raises":
            return result.get("phase") == self.phase and result.get("error") == self.error
        wrong = _differing(result)
        return _completed(result) and bool(wrong) and all(math.isfinite(d) for d in wrong.values())

    def seen_in(self, results) -> bool:
        """Does the world (one result dict per rank, ``None`` for a rank that crashed) show the bug?

        ``raises``: on every rank. ``wrong-values``: every rank completed the round trip, at least
        one loaded other values (a rank reading another rank's shard leaves the others exact), and
        every tensor any rank got wrong is another rank's, by the ``digests`` each rank reports.
        """
        if any(r is None for r in results) or not results:
            return False
        if self.kind == "raises":
            return all(self.matches(r) for r in results)
        if not all(_completed(r) for r in results):
            return False
        wrong = [(rank, r) for rank, r in enumerate(results) if _differing(r)]
        return bool(wrong) and all(
            self.matches(r) and all(_another_ranks(results, rank, key) for key in _differing(r)) for rank, r in wrong
        )

    def __repr__(self):
        return f"Bug({self.kind!r}, {self.phase!r}, {self.error!r})"


def _completed(result: dict) -> bool:
    """The round trip ran to the end: no error, or only the comparison's own assertion."""
    return bool(result.get("max_delta")) and result.get("phase") in (None, "compare")


def _differing(result: dict) -> dict:
    return {k: d for k, d in (result.get("max_delta") or {}).items() if d != 0.0}


def _another_ranks(results, rank: int, key: str) -> bool:
    """Every part of ``key`` that ``rank`` loaded is what it saved or what another rank saved
    there (``digests``: key -> (saved part digests, loaded part digests))."""
    saved, loaded = (results[rank].get("digests") or {}).get(key, ((), ()))
    others = [(r.get("digests") or {}).get(key, ((), ()))[0] for j, r in enumerate(results) if j != rank]
    if not loaded or len(saved) != len(loaded):
        return False
    return all(
        got == own or any(len(other) == len(loaded) and other[i] == got for other in others)
        for i, (own, got) in enumerate(zip(saved, loaded))
    )


class Scenario:
    """One round trip of one fix.

    ``func`` and ``prepare`` are ``"package.module:function"`` strings. ``prepare()`` runs in the
    parent before any world is started (forked ranks inherit what it did: stand-ins for optional
    packages that must be in place before Megatron imports, and the Megatron imports themselves,
    so each world forks warm). ``nproc``: the world size the scenario is written for.

    ``batch``: the fix's entry point that runs several of its scenarios in one world,
    ``(rank, world_size, ckpt_dir, patched, device="cpu", names=None) -> {scenario name: result}``
    (each result as ``func`` returns it alone), or None. A run of many scenarios (the GPU check)
    starts one world per half for all the scenarios of a fix that name the same ``batch``.

    ``alongside``: fix ids kept on in the fix-off half, where without them this release stops
    before anything this fix changes (each a bug of its own); every other fix is off there.
    """

    __slots__ = (
        "fix_id",
        "name",
        "func",
        "nproc",
        "bug",
        "prepare",
        "devices",
        "timeout",
        "doc",
        "requires",
        "applicable",
        "batch",
        "alongside",
    )

    def __init__(
        self,
        fix_id,
        name,
        func,
        nproc,
        bug,
        prepare=None,
        devices=("cpu", "cuda"),
        timeout=240.0,
        doc="",
        requires=(),
        applicable=None,
        batch=None,
        alongside=(),
    ):
        self.fix_id = fix_id
        self.name = name
        self.func = func
        self.nproc = nproc
        self.bug = bug
        self.prepare = prepare
        self.devices = tuple(devices)
        self.timeout = timeout
        self.doc = doc
        self.requires = tuple(requires)
        self.applicable = applicable  # "module:function" -> None, or why this release cannot run it
        self.batch = batch
        self.alongside = tuple(alongside)

    def absent(self):
        """The first of ``requires`` (``"module:attribute"`` or ``"module:Class.attribute"``: the Megatron feature the scenario
        exercises) that this installation lacks, as a sentence, or what the ``applicable`` check says
        (an API the scenario needs that differs in this release); None when it can run."""
        for ref in self.requires:
            module_name, _, attr = ref.partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                return f"{module_name} is not importable"
            owner = module
            for part in attr.split(".") if attr else ():
                if not hasattr(owner, part):
                    return f"{module_name} has no {attr}"
                owner = getattr(owner, part)
        if self.applicable is not None:
            return resolve(self.applicable)()
        return None

    def bug_for(self, version):
        """The :class:`Bug` the fix-off half shows on ``version`` (a ``packaging`` Version or None);
        None where no declared release line matches."""
        if isinstance(self.bug, Bug):
            return self.bug
        from packaging.specifiers import SpecifierSet

        for spec, bug in self.bug.items():
            if version is not None and version in SpecifierSet(spec, prereleases=True):
                return bug
        return None

    def off_env(self) -> dict:
        """The environment of the fix-off half: every fix off but ``alongside``."""
        from ..engine.flags import GLOBAL_VAR

        return {GLOBAL_VAR: ",".join(self.alongside) or "off"}

    @property
    def id(self) -> str:
        return f"{self.fix_id}/{self.name}"

    def __repr__(self):
        return f"Scenario({self.id!r})"


def resolve(ref: str):
    """``"package.module:function"`` -> the function (imports the module)."""
    module_name, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _declared(fix):
    """The scenarios ``fix``'s package declares (``<package>.checks.scenarios.SCENARIOS``), or none."""
    home = getattr(fix, "home", None)
    if not home:
        return ()
    path = f"{home}.checks.scenarios"  # CONTRIBUTING.md, "Adding a fix"
    try:
        module = importlib.import_module(path)
    except ModuleNotFoundError as exc:
        if exc.name not in (path, path.rpartition(".")[0]):
            raise  # the module exists and something it imports is missing
        return ()
    return tuple(getattr(module, "SCENARIOS", ()))


def all_scenarios():
    """Every registered scenario, fixes in ``status`` order, each fix's in declaration order."""
    from ..engine.registry import ENGINE

    found = []
    for fix in ENGINE.discover().values():
        found.extend(_declared(fix))
    return tuple(found)


def for_fix(fix_id: str):
    """The scenarios registered for ``fix_id``, in declaration order (possibly none)."""
    return tuple(s for s in all_scenarios() if s.fix_id == fix_id)
