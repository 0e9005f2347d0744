"""Parse the ``MCORE_CKPT_FIXES`` / ``MCORE_CKPT_FIX_<ID>`` environment flags.

Parsing is strict on purpose: a typo in a flag silently leaving a fix off is exactly the kind of
quiet checkpoint failure this package exists to prevent.
"""

from __future__ import annotations

import os

GLOBAL_VAR = "MCORE_CKPT_FIXES"
PER_FIX_PREFIX = "MCORE_CKPT_FIX_"
GLOBAL_VALUES = ("auto", "off")
MODES = ("auto", "off", "on", "require")


def env_var_for(fix_id: str) -> str:
    """``gdn-fsdp-split`` -> ``MCORE_CKPT_FIX_GDN_FSDP_SPLIT``."""
    return PER_FIX_PREFIX + fix_id.upper().replace("-", "_")


class Flags:
    __slots__ = ("modes",)

    def __init__(self, modes):
        self.modes = modes  # fix id -> one of MODES


def parse(fix_ids, environ=None) -> Flags:
    """Return the effective mode of every fix, or raise :class:`FlagError`."""
    environ = os.environ if environ is None else environ
    ids = list(fix_ids)
    default_mode, selected = _global(environ, ids)
    modes = {}
    for fix_id in ids:
        left_out = default_mode == "off" or (selected is not None and fix_id not in selected)
        modes[fix_id] = "off" if left_out else "auto"
    for fix_id, value in _per_fix(environ, ids):
        # A per-fix flag refines the global one; it can switch a fix on even when the global list
        # leaves it out, but never on when the global switch says everything is off.
        if default_mode == "off" and value != "off":
            continue
        if value != "auto" or modes[fix_id] != "off":
            modes[fix_id] = value
    return Flags(modes)


def _global(environ, ids):
    """``MCORE_CKPT_FIXES``: (the default mode, the set of fix ids it selects or None for all)."""
    from .errors import FlagError

    raw = environ.get(GLOBAL_VAR, "auto").strip()
    if raw.lower() in GLOBAL_VALUES:
        return raw.lower(), None
    names = [n.strip() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in ids]
    if not names or unknown:
        raise FlagError(
            f"{GLOBAL_VAR}={raw!r}: unknown fix id {', '.join(unknown) or '(empty list)'}; "
            f"accepted: auto, off, or a comma list of {', '.join(ids)}"
        )
    return "auto", set(names)


def _per_fix(environ, ids):
    """Every ``MCORE_CKPT_FIX_<ID>`` set: (fix id, mode), in the variables' order."""
    from .errors import FlagError

    by_var = {env_var_for(i): i for i in ids}
    for var in sorted(environ):
        if not var.startswith(PER_FIX_PREFIX):
            continue
        if var not in by_var:
            raise FlagError(f"{var}: no fix with that id; accepted variables: {', '.join(sorted(by_var))}")
        value = environ[var].strip().lower()
        if value not in MODES:
            raise FlagError(f"{var}={environ[var]!r}: accepted values: {', '.join(MODES)}")
        yield by_var[var], value
