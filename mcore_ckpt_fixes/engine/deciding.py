"""Deciding one target: the version gate, then the probe, giving a verdict with its reason.

Nothing here changes any state: :func:`decide` reads the versions and runs the fix's probe (which
runs the release's code on stand-ins, never writing a global) and says what should happen. The
registry records it and, for ``patch``, applies (:mod:`.applying`).
"""

from __future__ import annotations

from . import version as _version

# What decide() may say. patch: the bug is there, apply the fix; defer: probe again once the
# running Megatron import has finished; left-alone: the probe could not judge the code.
PATCH, DEFER, LEFT_ALONE = "patch", "defer", "left-alone"
NOT_NEEDED, NOT_APPLICABLE = "not-needed", "not-applicable"


class Verdict:
    __slots__ = ("outcome", "reason")

    def __init__(self, outcome: str, reason: str):
        self.outcome, self.reason = outcome, reason

    def __repr__(self):
        return f"Verdict({self.outcome!r}, {self.reason!r})"


class Gate:
    """The version that gates a target, and the range it is checked against."""

    __slots__ = ("name", "version", "source", "affected")

    def __init__(self, name, version, source, affected):
        self.name, self.version, self.source, self.affected = name, version, source, affected


def gate(fix, target, info) -> Gate:
    """Megatron-Core's version (wheel or checkout), or the installed version of the package the
    target declares (a framework's own copy of the buggy code)."""
    affected = target.affected if target.affected is not None else fix.affected
    if target.gated_by_megatron:
        return Gate("Megatron-Core", info.version, info.source, affected)
    return Gate(target.package, _version.package_version(target.package), "wheel", affected)


def decide(fix, target, module, mode: str, info, may_defer: bool) -> Verdict:
    """What to do with ``target`` of ``fix`` in ``module`` under flag ``mode``. ``may_defer``: a
    raising probe inside a running Megatron import may be tried again once it has finished."""
    found = gate(fix, target, info)
    outside = found.version is not None and found.version not in target.specifiers(fix)
    if outside and mode != "on" and found.source != "checkout":
        return Verdict(NOT_NEEDED, f"{found.name} {found.version} is outside the affected range {found.affected}")
    # A Megatron-LM checkout's version string may name a release its code does not match (a dev
    # tree of the next release, a pinned commit between releases): there the probe decides.
    note = ""
    if outside:
        note = (
            f" (checkout: its version {found.version} is outside the affected range {found.affected}; decided by the probe)"
            if mode != "on"
            else " (forced on outside the affected range)"
        )
    try:
        verdict, why = target.probe(module)
    except Exception as exc:  # a probe must never break the user's import
        return _probe_raised(exc, may_defer)
    if verdict is None:
        return Verdict(NOT_APPLICABLE, why)
    if verdict is False:
        return Verdict(NOT_NEEDED, f"probe: {why}{note if mode != 'on' else ''}")
    return Verdict(PATCH, f"{why}{note}")


def _probe_raised(exc: Exception, may_defer: bool) -> Verdict:
    from . import hooks

    kind = type(exc).__name__
    if may_defer and hooks.importing():
        # The target finished importing inside another Megatron module's import (a circular
        # chain): what the probe builds may need that half-initialised module.
        return Verdict(DEFER, f"probe deferred until the running Megatron import finishes ({kind})")
    # Code the probe does not know (upstream reworked it, a checkout between releases): it cannot
    # tell whether the bug is there, so the code is left alone, never patched blind.
    return Verdict(LEFT_ALONE, f"left alone: the probe could not judge this code ({kind}: {exc})")
