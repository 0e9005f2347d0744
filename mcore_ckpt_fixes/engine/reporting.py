"""What ``status`` and ``report()`` say, and the one summary line a process logs.

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

from . import flags as _flags
from . import logs
from . import version as _version
from .deciding import gate

# Which target state wins when a fix's targets disagree (most important first).
PRECEDENCE = ("failed", "applied", "pending", "not-needed", "not-applicable")


class TargetState:
    __slots__ = ("state", "reason")

    def __init__(self, state: str, reason: str):
        self.state = state
        self.reason = reason


def fix_state(engine, fix_id: str):
    """(state, reason) of one fix, its targets' states aggregated by :data:`PRECEDENCE`."""
    fix = engine.fixes[fix_id]
    mode = engine.modes.get(fix_id)
    if not engine.active or mode is None:
        return "disabled", "mcore_ckpt_fixes.apply() has not run (or revert() was called)"
    if mode == "off":
        return "disabled", f"{_flags.env_var_for(fix_id)} / {_flags.GLOBAL_VAR} switch it off"
    if not fix.implemented:
        return "unimplemented", f"not implemented yet in this release of mcore-ckpt-fixes ({fix.tracking})"
    states = reported_states(engine, fix)
    for wanted in PRECEDENCE:
        hits = [(m, s) for m, s in states.items() if s.state == wanted]
        if hits:
            return wanted, "; ".join(f"{m}: {s.reason}" for m, s in hits)
    return "not-applicable", "no target module"


def reported_states(engine, fix):
    """The targets' states as reported: a framework target still waiting for its module while the
    framework is not installed at all is not applicable here (decided only when asked: the lookup
    costs nothing at ``import mcore_ckpt_fixes``). Its hook stays: a framework imported from a
    source tree without an installed distribution is still patched when imported."""
    states = dict(engine.targets.get(fix.id, {}))
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


def rows(engine):
    """One dict per fix, in order: what ``status --json`` prints."""
    info = _version.detect()
    found = []
    for fix in engine.fixes.values():
        state, reason = fix_state(engine, fix.id)
        packages = {t.module: t.package for t in fix.targets}
        found.append(
            {
                "id": fix.id,
                "state": state,
                "reason": reason,
                "mode": engine.modes.get(fix.id, "off"),
                "summary": fix.summary,
                "affected": fix.affected,
                "upstream": list(fix.upstream),
                "targets": {
                    m: {"state": s.state, "reason": s.reason, "package": packages.get(m, "megatron-core")}
                    for m, s in reported_states(engine, fix).items()
                },
                "megatron_core": str(info.version) if info.version else None,
                "megatron_source": info.source,
                "megatron_path": info.path,
            }
        )
    return found


def summary_line(engine, fresh) -> str:
    """The INFO line naming the fixes applied since the last one, and those still waiting."""
    info = _version.detect()
    text = (
        f"mcore_ckpt_fixes: applied {', '.join(f for f in engine.fixes if f in fresh)} "
        f"(Megatron-Core {info.version or 'of unknown version'}, {info.source})"
    )
    waiting = _waiting(engine, info)
    if waiting:
        text += f"; applied when their modules are imported: {', '.join(waiting)}"
    return text + "; details: DEBUG log, `python -m mcore_ckpt_fixes status`"


def _waiting(engine, info):
    """Enabled fixes with nothing applied yet whose Megatron-Core target still waits for its module
    on a release in its range (or a checkout, where the probe decides)."""
    waiting = []
    for fix in engine.fixes.values():
        states = engine.targets.get(fix.id, {})
        if engine.modes.get(fix.id, "off") == "off" or any(s.state == "applied" for s in states.values()):
            continue
        if any(_waits(engine, fix, target, states.get(target.module), info) for target in fix.targets):
            waiting.append(fix.id)
    return waiting


def _waits(engine, fix, target, current, info) -> bool:
    if not target.gated_by_megatron or current is None or current.state != "pending":
        return False
    found = gate(fix, target, info)
    forced = engine.modes[fix.id] == "on" or found.source == "checkout"
    return forced or found.version is None or found.version in target.specifiers(fix)


def decided(fix_id: str, module_name: str, state: str, reason: str) -> None:
    logs.detail("mcore_ckpt_fixes: %s on %s: %s: %s", fix_id, module_name, state, reason)


def failed(fix_id: str, module_name: str, reason: str) -> None:
    """A target whose patch raised: every rank's MegatronPatchWarning, the job's (rank 0's) log line.
    The warning points where it pointed before the engine was split, at the call that reached the
    target (failed <- _fail <- _patch <- _apply_target <- that call)."""
    import warnings

    from .errors import MegatronPatchWarning

    warnings.warn(
        f"mcore_ckpt_fixes: {fix_id} not applied to {module_name}: {reason}", MegatronPatchWarning, stacklevel=5
    )
    if logs.first_rank():
        logs.logger().warning("mcore_ckpt_fixes: %s failed on %s: %s", fix_id, module_name, reason)
