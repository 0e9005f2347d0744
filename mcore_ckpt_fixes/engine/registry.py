"""The fixes, their flags and each target's state: the engine behind ``apply()``, ``revert()`` and
``status``. Deciding a target is :mod:`.deciding`'s (a verdict with its reason), applying and
rolling back :mod:`.applying`'s, what is reported :mod:`.reporting`'s (the states are listed there).
"""

from __future__ import annotations

import importlib
import sys
import threading

from . import deciding, logs, reporting
from . import flags as _flags
from . import version as _version
from .applying import apply_target, revert_all
from .errors import FixRequiredError
from .fix import Fix, Target
from .patching import Patcher, unbind_late_imports
from .reporting import TargetState

FIXES_PACKAGE = "mcore_ckpt_fixes.fixes"
# A decided target is not decided again (apply twice leaves one layer).
_SETTLED = ("applied", "not-needed", "not-applicable", "failed")


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
            self.modes = dict(_flags.parse(fixes, environ).modes)
            self.active = True
            info = _LazyInfo()
            required_failures = []
            for fix in fixes.values():
                mode = self.modes[fix.id]
                if mode == "off":
                    revert_all(self.patchers, [fix.id])  # as at start: no module bound its layers yet
                    self.targets[fix.id] = {}
                    continue
                if not fix.implemented:
                    continue
                for target in fix.targets:
                    self._reach(fix, target, mode, info)
                if mode == "require":
                    state, reason = self.fix_state(fix.id)
                    if state in ("failed", "not-applicable", "pending"):
                        required_failures.append(f"{fix.id}: {state}: {reason}")
            self._announce_when_settled()
            if required_failures:
                raise FixRequiredError("required fix could not be applied: " + "; ".join(required_failures))

    def _reach(self, fix: Fix, target: Target, mode: str, info) -> None:
        """Decide ``target`` now if its module is imported (or, for a ``require`` d fix, can be);
        else wait for its import."""
        states = self.targets.setdefault(fix.id, {})
        if sys.modules.get(target.module) is not None:
            self._apply_target(fix, target, sys.modules[target.module], info)
            return
        if mode == "require":
            try:
                importlib.import_module(target.module)
            except Exception as exc:
                states[target.module] = TargetState("not-applicable", f"cannot import {target.module}: {exc}")
            self._ensure_hook(target.module)
            if target.module in sys.modules:
                self._apply_target(fix, target, sys.modules[target.module], info)
            return
        states.setdefault(target.module, TargetState("pending", f"waiting for `import {target.module}`"))
        self._ensure_hook(target.module)

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
        current = self.targets.setdefault(fix.id, {}).get(target.module)
        if current is not None and current.state in _SETTLED:
            return
        verdict = deciding.decide(fix, target, module, self.modes[fix.id], info, not getattr(info, "retry", False))
        if verdict.outcome == deciding.DEFER:
            from . import hooks

            self.targets[fix.id][target.module] = TargetState("pending", verdict.reason)
            hooks.when_settled(lambda: self._retry(fix, target, module))
        elif verdict.outcome == deciding.LEFT_ALONE:
            self._left_alone(fix, target, verdict.reason)
        elif verdict.outcome != deciding.PATCH:
            self._decide(fix, target, verdict.outcome, verdict.reason)
        else:
            self._patch(fix, target, module, verdict.reason)

    def _patch(self, fix: Fix, target: Target, module, reason: str) -> None:
        patcher = self.patchers.get(fix.id)
        if patcher is None:
            # The fixes' order (fixes.ORDER, then registration) is their layers' order on a shared attribute.
            patcher = self.patchers[fix.id] = Patcher(fix.id, list(self.fixes).index(fix.id))
        error = apply_target(patcher, target, module)
        if error is not None:
            self._fail(fix, target, error)
            return
        self._decide(fix, target, "applied", reason)
        if fix.id not in self.fresh:
            self.fresh.append(fix.id)

    def _decide(self, fix: Fix, target: Target, state: str, reason: str) -> None:
        self.targets.setdefault(fix.id, {})[target.module] = TargetState(state, reason)
        reporting.decided(fix.id, target.module, state, reason)

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
            text = reporting.summary_line(self, fresh)
            if self.announced:  # this process has had its INFO line: the rest is detail
                logs.detail(text)
                return
            self.announced = True
            logs.once_per_job(text)

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
        reporting.failed(fix.id, target.module, reason)

    def revert(self, fix_ids=None) -> None:
        with self.lock:
            ids = list(self.discover()) if fix_ids is None else list(fix_ids)
            restore = revert_all(self.patchers, ids)
            for fix_id in ids:
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
        return reporting.fix_state(self, fix_id)

    def report(self):
        with self.lock:
            self.discover()
            return reporting.rows(self)


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
