"""Other packages' patches, in this process, of the checks a failing save relies on to fail loudly.

Some training frameworks switch torch's checkpoint checks off for speed. ms-swift's
``init_megatron_env`` (``swift/megatron/init.py``, 4.6.0; "too slow") replaces torch DCP's save-plan
validation, ``default_planner._validate_global_plan``, by one that accepts every plan, and
ShardedTensor's ``validate_non_overlapping_shards_metadata`` by one that does nothing. A catalogued
bug whose failure is that validation's error then writes its checkpoint without one: a chunk past
its tensor's end or two ranks' chunks over one region reach the disk, silently. ``status`` names each
such patch it finds, who made it, and the catalogued bugs it turns silent; ``inspect`` names the
traces such a save leaves (chunks that overlap or leave their tensor).

Read only: nothing here imports torch or a framework; a module not imported yet is not patched yet.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import List, Tuple

# Who a replacement's module belongs to, where a known framework made it.
OWNERS = (("swift.", "ms-swift"), ("slime.", "slime"))


@dataclass(frozen=True)
class Check:
    """A torch function a checkpoint's save relies on to refuse a wrong layout."""

    module: str
    name: str
    what: str
    silences: Tuple[str, ...]  # catalogued bugs whose only symptom is this check's error


CHECKS = (
    Check(
        "torch.distributed.checkpoint.default_planner",
        "_validate_global_plan",
        "torch DCP's save-plan validation (every chunk inside its tensor, no two chunks over one region, "
        "every element written)",
        ("dp-reshardable-padding-past-unpadded-end", "nvfp4-dp-reshardable-packed-global-shape"),
    ),
    Check(
        "torch.distributed._shard.sharded_tensor.api",
        "validate_non_overlapping_shards_metadata",
        "ShardedTensor's check that no two local shards overlap",
        (),
    ),
)


def owner(module_name: str) -> str:
    """The framework a module belongs to, or the module's own name."""
    for prefix, name in OWNERS:
        if module_name.startswith(prefix):
            return f"{name} ({module_name})"
    return module_name


def found() -> List[dict]:
    """Each check of :data:`CHECKS` whose module is imported and whose function there is not
    torch's own: ``{"check": "module.name", "by": owner, "what", "silences": [bug ids]}``."""
    out = []
    for check in CHECKS:
        module = sys.modules.get(check.module)
        fn = getattr(module, check.name, None) if module is not None else None
        where = getattr(fn, "__module__", None) or ""
        if fn is None or where == "torch" or where.startswith("torch."):
            continue
        out.append(
            {
                "check": f"{check.module}.{check.name}",
                "by": owner(where),
                "what": check.what,
                "silences": list(check.silences),
            }
        )
    return out


def describe(patch: dict, bugs: List[dict], states: dict) -> str:
    """One line for ``status``: the patch, who made it, and each bug it silences with its state here
    (``bugs``: the catalogue; ``states``: fix id -> its state in this process)."""
    by_id = {b["id"]: b for b in bugs}
    named = []
    for bug_id in patch["silences"]:
        bug = by_id.get(bug_id, {})
        fix = bug.get("fix")
        state = f"fixed by {fix}: {states.get(fix, 'unknown')}" if fix else bug.get("status", "not catalogued")
        named.append(f"{bug_id} ({state})")
    line = f"{patch['check']} is replaced by {patch['by']}: {patch['what']} is off, a save it would stop is written"
    return line + (f"; catalogued bugs it turns silent: {', '.join(named)}" if named else "")


# Frameworks measured to make such a patch when they set up a training process: distribution name,
# the call that makes it, the checks it replaces, the release it was measured on.
KNOWN_PATCHERS = (("ms-swift", "swift.megatron.init.init_megatron_env", CHECKS, "4.6.0"),)


def installed() -> List[dict]:
    """The known patchers installed here (read from their distribution metadata; nothing is
    imported): ``{"package", "version", "call", "checks", "measured"}``."""
    from importlib import metadata

    out = []
    for package, call, checks, measured in KNOWN_PATCHERS:
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
        out.append({"package": package, "version": version, "call": call, "checks": checks, "measured": measured})
    return out


def as_json(bugs: List[dict], states: dict) -> dict:
    """``status --known-bugs --json``'s ``other_patches``: what :func:`status_lines` says, as data
    (``active``: each patch found, each bug it silences with its state here; ``installed``: the known
    patchers installed, whether this version was measured)."""
    by_id = {b["id"]: b for b in bugs}

    def bug_state(bug_id):
        bug = by_id.get(bug_id, {})
        fix = bug.get("fix")
        return {"id": bug_id, "status": bug.get("status", "not catalogued"), "fix": fix, "fix_state": states.get(fix)}

    active = [{**p, "silences": [bug_state(b) for b in p["silences"]]} for p in found()]
    installed_here = [
        {
            "package": p["package"],
            "version": p["version"],
            "call": p["call"],
            "replaces": [f"{c.module}.{c.name}" for c in p["checks"]],
            "measured": p["version"] == p["measured"],
            "silences": sorted({b for c in p["checks"] for b in c.silences}),
        }
        for p in installed()
    ]
    return {"active": active, "installed": installed_here}


def status_lines(bugs: List[dict], states: dict) -> List[str]:
    """``status``'s section (empty where there is nothing to say): the patches active in this
    process, then the known patchers installed here."""
    lines = [f"  active: {describe(p, bugs, states)}" for p in found()]
    for p in installed():
        measured = "measured" if p["version"] == p["measured"] else f"measured on {p['measured']}, not on this release"
        names = ", ".join(f"{c.module}.{c.name}" for c in p["checks"])
        silenced = sorted({b for c in p["checks"] for b in c.silences})
        lines.append(
            f"  installed: {p['package']} {p['version']}: {p['call']} replaces {names} in the processes it "
            f"sets up ({measured}); catalogued bugs it turns silent there: {', '.join(silenced) or 'none'}"
        )
    return ["other patch layers:"] + lines if lines else []
