"""Discover fixes, decide per target whether to patch, and keep the state ``status`` reports.

States, per fix (aggregated over its targets):
  applied         the bug was found and the patch is in place
  pending         enabled, but a target module has not been imported yet (a post-import hook waits)
  not-needed      this release does not have the bug (outside the affected range, or the probe says fixed)
  not-applicable  the feature the fix patches is absent from this release (or Megatron-Core is absent),
                  or its probe could not judge the code it found (left alone, with the reason)
  disabled        switched off by a flag
  failed          the patch raised; training goes on unpatched (MegatronPatchWarning)
  unimplemented   registered, not written yet: nothing is patched
"""

from __future__ import annotations

import importlib
import sys
import threading

from . import flags as _flags
from . import logs
from . import version as _version
from .errors import FixRequiredError, MegatronPatchWarning
from .fix import Fix, Target
from .patching import Patcher, unbind_late_imports

FIXES_PACKAGE = "mcore_ckpt_fixes.fixes"
# Which target state wins when a fix's targets disagree (most important first).
_PRECEDENCE = ("failed", "applied", "pending", "not-needed", "not-applicable")


class TargetState:
    __slots__ = ("state", "reason")

    def __init__(self, state: str, reason: str):
        self.state = state
        self.reason = reason


class _Engine:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.fixes = {}  # id -> Fix
        self.modes = {}  # id -> mode
        self.targets = {}  # id -> {module name -> TargetState}
        self.patchers = {}  # id -> Patcher
        self.hooked: set = set()  # module names with a post-import hook (kept: on_import checks state)
        self.active = False
        # The summary line (logs.py): fix ids applied since the last one, whether one is waiting for
        # the running import to finish, whether this process has logged its one INFO summary.
        self.fresh = []
        self.announcing = False
        self.announced = False

    # -- discovery -----------------------------------------------------------------------------
    def discover(self):
        """The shipped fixes, in ``fixes.ORDER`` (the one list of them): each id's package
        (``-`` as ``_``) declares ``FIX``."""
        if not self.fixes:
            order = importlib.import_module(FIXES_PACKAGE).ORDER
            for fix_id in order:
                home = f"{FIXES_PACKAGE}.{fix_id.replace('-', '_')}"
                self.fixes[fix_id] = importlib.import_module(home).FIX.settle(home)
        return self.fixes

    def register(self, fix: Fix) -> None:
        """Add a fix not shipped in ``mcore_ckpt_fixes.fixes`` (tests, site-local fixes)."""
        with self.lock:
            self.discover()
            self.fixes[fix.id] = fix

    # -- apply / revert ------------------------------------------------------------------------
    def apply(self, environ=None) -> None:
        with self.lock:
            fixes = self.discover()
            modes = _flags.parse(fixes, environ).modes
            self.modes = dict(modes)
            self.active = True
            info = _LazyInfo()
            required_failures = []
            for fix in fixes.values():
                mode = modes[fix.id]
                states = self.targets.setdefault(fix.id, {})
                if mode == "off":
                    self._revert_fix(fix.id)
                    self.targets[fix.id] = {}
                    continue
                if not fix.implemented:
                    continue
                for target in fix.targets:
                    if target.module in sys.modules and sys.modules[target.module] is not None:
                        self._apply_target(fix, target, sys.modules[target.module], info)
                    elif mode == "require":
                        try:
                            importlib.import_module(target.module)  # runs the hook below
                        except Exception as exc:
                            states[target.module] = TargetState(
                                "not-applicable", f"cannot import {target.module}: {exc}"
                            )
                        self._ensure_hook(target.module)
                        if target.module in sys.modules:
                            self._apply_target(fix, target, sys.modules[target.module], info)
                    else:
                        states.setdefault(
                            target.module,
                            TargetState("pending", f"waiting for `import {target.module}`"),
                        )
                        self._ensure_hook(target.module)
                if mode == "require":
                    state, reason = self.fix_state(fix.id)
                    if state in ("failed", "not-applicable", "pending"):
                        required_failures.append(f"{fix.id}: {state}: {reason}")
            self._announce_when_settled()
            if required_failures:
                raise FixRequiredError("required fix could not be applied: " + "; ".join(required_failures))

    def _ensure_hook(self, module_name: str) -> None:
        if module_name in self.hooked:
            return
        from . import hooks

        self.hooked.add(module_name)
        hooks.register(module_name, _on_import)

    def on_import(self, module) -> None:
        with self.lock:
            if not self.active:
                return
            info = _LazyInfo()
            for fix in self.fixes.values():
                if self.modes.get(fix.id, "off") == "off" or not fix.implemented:
                    continue
                for target in fix.targets:
                    if target.module == module.__name__:
                        self._apply_target(fix, target, module, info)
            self._announce_when_settled()

    def _apply_target(self, fix: Fix, target: Target, module, info) -> None:
        states = self.targets.setdefault(fix.id, {})
        current = states.get(target.module)
        if current is not None and current.state in ("applied", "not-needed", "not-applicable", "failed"):
            return  # decided already: apply twice leaves one layer
        mode = self.modes[fix.id]
        gate = _gate(fix, target, info)
        outside = gate.version is not None and gate.version not in target.specifiers(fix)
        if outside and mode != "on" and gate.source != "checkout":
            outside_range = f"{gate.name} {gate.version} is outside the affected range {gate.affected}"
            self._decide(fix, target, "not-needed", outside_range)
            return
        # A Megatron-LM checkout's version string may name a release its code does not match (a dev
        # tree of the next release, a pinned commit between releases): there the probe decides.
        checkout_note = (
            f" (checkout: its version {gate.version} is outside the affected range {gate.affected}; decided by the probe)"
            if outside and mode != "on"
            else ""
        )
        try:
            verdict, why = target.probe(module)
        except Exception as exc:  # a probe must never break the user's import
            from . import hooks

            if hooks.importing() and not getattr(info, "retry", False):
                # The target finished importing inside another Megatron module's import (a circular
                # chain): what the probe builds may need that half-initialised module. Probe again
                # once the outermost import has finished.
                states[target.module] = TargetState(
                    "pending", f"probe deferred until the running Megatron import finishes ({type(exc).__name__})"
                )
                hooks.when_settled(lambda: self._retry(fix, target, module))
                return
            # Code the probe does not know (upstream reworked it, a checkout between releases): it
            # cannot tell whether the bug is there, so the code is left alone, never patched blind.
            self._left_alone(
                fix, target, f"left alone: the probe could not judge this code ({type(exc).__name__}: {exc})"
            )
            return
        if verdict is None:
            self._decide(fix, target, "not-applicable", why)
            return
        if verdict is False:
            self._decide(fix, target, "not-needed", f"probe: {why}{checkout_note}")
            return
        patcher = self.patchers.get(fix.id)
        if patcher is None:
            # The fixes' order (fixes.ORDER, then registration) is their layers' order on a shared attribute.
            patcher = self.patchers[fix.id] = Patcher(fix.id, list(self.fixes).index(fix.id))
        mark = len(patcher.records)
        try:
            target.apply(module, patcher)
        except Exception as exc:
            # Undo the half-applied part of this target only.
            partial = Patcher(fix.id)
            partial.records = patcher.records[mark:]
            del patcher.records[mark:]
            partial.revert(whole=False)
            self._fail(fix, target, f"patch raised {type(exc).__name__}: {exc}")
            return
        note = checkout_note or ("" if not outside else " (forced on outside the affected range)")
        self._decide(fix, target, "applied", f"{why}{note}")
        if fix.id not in self.fresh:
            self.fresh.append(fix.id)

    def _decide(self, fix: Fix, target: Target, state: str, reason: str) -> None:
        self.targets.setdefault(fix.id, {})[target.module] = TargetState(state, reason)
        logs.detail("mcore_ckpt_fixes: %s on %s: %s: %s", fix.id, target.module, state, reason)

    # -- the summary line ------------------------------------------------------------------------
    def _announce_when_settled(self) -> None:
        """One summary for everything a Megatron import applied: logged once the outermost import
        has finished (at once outside an import)."""
        if not self.fresh or self.announcing:
            return
        from . import hooks

        self.announcing = True
        hooks.when_settled(self._announce)

    def _announce(self) -> None:
        with self.lock:
            self.announcing = False
            fresh, self.fresh = self.fresh, []
            if not fresh:
                return
            info = _version.detect()
            text = (
                f"mcore_ckpt_fixes: applied {', '.join(f for f in self.fixes if f in fresh)} "
                f"(Megatron-Core {info.version or 'of unknown version'}, {info.source})"
            )
            waiting = self._waiting(info)
            if waiting:
                text += f"; applied when their modules are imported: {', '.join(waiting)}"
            text += "; details: DEBUG log, `python -m mcore_ckpt_fixes status`"
            if self.announced:  # this process has had its INFO line: the rest is detail
                logs.detail(text)
                return
            self.announced = True
            logs.once_per_job(text)

    def _waiting(self, info):
        """Enabled fixes with nothing applied yet whose Megatron-Core target still waits for its
        module on a release in its range (or a checkout, where the probe decides)."""
        waiting = []
        for fix in self.fixes.values():
            states = self.targets.get(fix.id, {})
            if self.modes.get(fix.id, "off") == "off" or any(s.state == "applied" for s in states.values()):
                continue
            for target in fix.targets:
                current = states.get(target.module)
                if not target.gated_by_megatron or current is None or current.state != "pending":
                    continue
                gate = _gate(fix, target, info)
                forced = self.modes[fix.id] == "on" or gate.source == "checkout"
                if forced or gate.version is None or gate.version in target.specifiers(fix):
                    waiting.append(fix.id)
                    break
        return waiting

    def enabled_target_modules(self, installed_only: bool = False):
        """(fix id, module name) of every target of every enabled, implemented fix, in order.
        installed_only: leave out framework targets whose distribution is not installed or does
        not ship the target module."""
        with self.lock:
            return [
                (fix.id, target.module)
                for fix in self.discover().values()
                if self.modes.get(fix.id, "off") != "off" and fix.implemented
                for target in fix.targets
                if not installed_only
                or target.gated_by_megatron
                or (
                    _version.package_version(target.package) is not None
                    and _version.ships_module(target.package, target.module) is not False
                )
            ]

    def _retry(self, fix: Fix, target: Target, module) -> None:
        with self.lock:
            if not self.active or self.modes.get(fix.id, "off") == "off":
                return
            states = self.targets.setdefault(fix.id, {})
            if states.get(target.module) is not None and states[target.module].state != "pending":
                return
            states.pop(target.module, None)
            info = _LazyInfo()
            info.retry = True
            self._apply_target(fix, target, module, info)
            self._announce_when_settled()

    def mark_unimportable(self, fix_id: str, module_name: str, reason: str) -> None:
        with self.lock:
            self.targets.setdefault(fix_id, {})[module_name] = TargetState(
                "not-applicable", f"cannot import {module_name}: {reason}"
            )

    def _left_alone(self, fix: Fix, target: Target, reason: str) -> None:
        """Not patched because the probe could not judge the code: not applicable here, with the
        reason; a ``require`` d fix raises, as when it fails."""
        self._decide(fix, target, "not-applicable", reason)
        if self.modes.get(fix.id) == "require":
            raise FixRequiredError(f"required fix {fix.id} cannot apply on {target.module}: {reason}")

    def _fail(self, fix: Fix, target: Target, reason: str) -> None:
        self._decide(fix, target, "failed", reason)
        if self.modes.get(fix.id) == "require":
            raise FixRequiredError(f"required fix {fix.id} failed on {target.module}: {reason}")
        import warnings

        warnings.warn(
            f"mcore_ckpt_fixes: {fix.id} not applied to {target.module}: {reason}",
            MegatronPatchWarning,
            stacklevel=3,
        )
        # The MegatronPatchWarning above is every rank's; the log line is the job's (rank 0's).
        if logs.first_rank():
            logs.logger().warning("mcore_ckpt_fixes: %s failed on %s: %s", fix.id, target.module, reason)

    def _revert_fix(self, fix_id: str) -> dict:
        patcher = self.patchers.pop(fix_id, None)
        return patcher.revert(sweep=False) if patcher is not None else {}

    def revert(self, fix_ids=None) -> None:
        with self.lock:
            ids = list(self.discover()) if fix_ids is None else list(fix_ids)
            restore = {}
            for fix_id in ids:
                restore.update(self._revert_fix(fix_id))
                self.targets[fix_id] = {}
            # One walk over every module's globals for all the fixes, not one per fix (a forked
            # test or selftest rank reverts at start: this walk was most of its start-up).
            unbind_late_imports(restore)
            if fix_ids is None:
                self.active = False
                self.modes = {}
            else:
                for fix_id in ids:
                    self.modes[fix_id] = "off"

    def changes(self, fix_id: str):
        """What the fix changed in this process, in order: records with ``owner``, ``name``,
        ``before`` (the original; the patching module's sentinel where it was only inherited)
        and ``after`` (the replacement). Empty when it changed nothing."""
        with self.lock:
            patcher = self.patchers.get(fix_id)
            return tuple(patcher.records) if patcher is not None else ()

    # -- report --------------------------------------------------------------------------------
    def fix_state(self, fix_id: str):
        fix = self.fixes[fix_id]
        mode = self.modes.get(fix_id)
        if not self.active or mode is None:
            return "disabled", "mcore_ckpt_fixes.apply() has not run (or revert() was called)"
        if mode == "off":
            return "disabled", f"{_flags.env_var_for(fix_id)} / {_flags.GLOBAL_VAR} switch it off"
        if not fix.implemented:
            return "unimplemented", f"not implemented yet in this release of mcore-ckpt-fixes ({fix.tracking})"
        states = self._reported_states(fix)
        for wanted in _PRECEDENCE:
            hits = [(m, s) for m, s in states.items() if s.state == wanted]
            if hits:
                return wanted, "; ".join(f"{m}: {s.reason}" for m, s in hits)
        return "not-applicable", "no target module"

    def _reported_states(self, fix: Fix):
        """The targets' states as reported: a framework target still waiting for its module while
        the framework is not installed at all is not applicable here (decided only when asked: the
        lookup costs nothing at ``import mcore_ckpt_fixes``). Its hook stays: a framework imported
        from a source tree without an installed distribution is still patched when imported."""
        states = dict(self.targets.get(fix.id, {}))
        for target in fix.targets:
            current = states.get(target.module)
            if current is None or current.state != "pending" or target.gated_by_megatron:
                continue
            version = _version.package_version(target.package)
            if version is None:
                states[target.module] = TargetState(
                    "not-applicable",
                    f"{target.package} is not installed (no {target.package} distribution; patched when "
                    f"{target.module} is imported all the same)",
                )
            elif _version.ships_module(target.package, target.module) is False:
                states[target.module] = TargetState(
                    "not-applicable", f"{target.package} {version} does not ship {target.module}"
                )
        return states

    def report(self):
        with self.lock:
            fixes = self.discover()
            info = _version.detect()
            rows = []
            for fix in fixes.values():
                state, reason = self.fix_state(fix.id)
                packages = {t.module: t.package for t in fix.targets}
                rows.append(
                    {
                        "id": fix.id,
                        "state": state,
                        "reason": reason,
                        "mode": self.modes.get(fix.id, "off"),
                        "summary": fix.summary,
                        "affected": fix.affected,
                        "upstream": list(fix.upstream),
                        "targets": {
                            m: {"state": s.state, "reason": s.reason, "package": packages.get(m, "megatron-core")}
                            for m, s in self._reported_states(fix).items()
                        },
                        "megatron_core": str(info.version) if info.version else None,
                        "megatron_source": info.source,
                        "megatron_path": info.path,
                    }
                )
            return rows


class _Gate:
    __slots__ = ("name", "version", "source", "affected")

    def __init__(self, name, version, source, affected):
        self.name, self.version, self.source, self.affected = name, version, source, affected


def _gate(fix: Fix, target: Target, info) -> _Gate:
    """The version that gates ``target``: Megatron-Core's (wheel or checkout), or the installed
    version of the package the target declares (a framework's own copy of the buggy code)."""
    affected = target.affected if target.affected is not None else fix.affected
    if target.gated_by_megatron:
        return _Gate("Megatron-Core", info.version, info.source, affected)
    return _Gate(target.package, _version.package_version(target.package), "wheel", affected)


class _LazyInfo:
    """The Megatron-Core version, detected only when a target is actually reached."""

    def __getattr__(self, name):
        info = _version.detect()
        self.version, self.source, self.path = info.version, info.source, info.path
        return getattr(info, name)


ENGINE = _Engine()


def _on_import(module) -> None:
    # Module-level, so the hook registry holds no bound method of the engine; the engine decides.
    ENGINE.on_import(module)
