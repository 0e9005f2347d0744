"""The catalogue of known checkpoint bugs of the supported Megatron-Core releases.

Each entry names a bug a user can meet on save or resume, the releases it affects and what this
package does about it: ``fixed`` or ``guarded`` by one of its fixes, ``open`` (reproduced here, no fix
yet), ``not-in-scope`` (why) or ``not-reproduced`` (how it was tried). ``status`` prints how many affect
the running release; docs/known-bugs.md is generated from the same files by tools/docs.py.

Where an entry lives: one a fix covers in that fix's folder, ``fixes/<fix>/bugs.json``
(``{"bugs": [...]}``, status ``fixed`` or ``guarded``, no ``fix`` field: the folder names the fix; a
fix without bugs is a folder without the file), so a new fix brings its entries with it; every other
entry in ``known_bugs.json`` beside this module (``{"about": ..., "bugs": [...]}``), which holds no
fixed or guarded entry. :func:`load` gives the fixes' entries first, fix by fix in ``fixes.ORDER``,
then the central file's, each fix's entry with its ``fix`` filled in; ids are unique across all files.

The data is JSON, not TOML: ``tomllib`` exists from Python 3.11 only and the package supports 3.10, and
a hand-written TOML reader for 3.10 would be a code path that no test line (3.11, 3.12) exercises.

Nothing here is imported by ``import mcore_ckpt_fixes``: the files are read on first use.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
# The central file: the entries no fix covers.
PATH = os.path.join(HERE, "known_bugs.json")
# The fix packages' folder: ``<FIXES_DIR>/<fix id with _ for ->/bugs.json`` holds a fix's entries.
FIXES_DIR = os.path.join(HERE, "fixes")
FIX_FILE = "bugs.json"
# The order ``status`` and the docs count them in.
STATUSES = ("fixed", "guarded", "open", "not-in-scope", "not-reproduced")
# The statuses of an entry a fix covers (the only ones in a fix's folder, never in the central file).
FIX_STATUSES = ("fixed", "guarded")
# Per status, the field that must say more: the fix's id, how it was reproduced or tried, or why not.
DETAIL = {"fixed": "fix", "guarded": "fix", "open": "how", "not-in-scope": "why", "not-reproduced": "how"}
REQUIRED = ("id", "symptom", "affected", "upstream", "status", "silent")
OPTIONAL = ("fix", "how", "why", "note")
CENTRAL = "known_bugs.json"


class KnownBugsError(ValueError):
    """The catalogue is malformed: one line naming the file, the entry and the field."""


def _fail(where: str, field: str, problem: str, source: str = CENTRAL) -> None:
    raise KnownBugsError(f"{source}: {where}: field {field!r}: {problem}")


def _check_text(entry: dict, where: str, field: str, source: str) -> None:
    value = entry.get(field)
    if not isinstance(value, str) or not value.strip():
        _fail(where, field, f"expected a non-empty string, got {value!r}", source)


def _check_affected(entry: dict, where: str, source: str) -> None:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    _check_text(entry, where, "affected", source)
    try:
        SpecifierSet(entry["affected"])
    except InvalidSpecifier as exc:
        _fail(where, "affected", f"not a PEP 440 specifier set ({exc})", source)


def _check_status(entry: dict, where: str, fix_ids, source: str) -> None:
    status = entry.get("status")
    if status not in STATUSES:
        _fail(where, "status", f"{status!r} is not one of {', '.join(STATUSES)}", source)
    detail = DETAIL[status]
    _check_text(entry, where, detail, source)
    for other in ("fix", "how", "why"):
        if other != detail and other in entry:
            _fail(where, other, f"not used with status {status!r} (which takes {detail!r})", source)
    if detail == "fix" and entry["fix"] not in fix_ids:
        _fail(where, "fix", f"{entry['fix']!r} is not a fix of this package ({', '.join(fix_ids)})", source)


def _where(entry, index: int) -> str:
    if isinstance(entry, dict) and isinstance(entry.get("id"), str) and entry["id"]:
        return f"entry {index} ({entry['id']})"
    return f"entry {index}"


def check_entry(entry, index: int, fix_ids, source: str = CENTRAL) -> None:
    """Raise :class:`KnownBugsError` for the first problem of one entry (``fix`` filled in for a
    fix's entry); ``source`` names its file in the message."""
    where = _where(entry, index)
    if not isinstance(entry, dict):
        _fail(where, "-", f"expected an object, got {type(entry).__name__}", source)
    for field in REQUIRED:
        if field not in entry:
            _fail(where, field, "missing", source)
    unknown = sorted(set(entry) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        _fail(where, unknown[0], f"unknown field (known: {', '.join(REQUIRED + OPTIONAL)})", source)
    for field in ("id", "symptom"):
        _check_text(entry, where, field, source)
    _check_affected(entry, where, source)
    refs = entry["upstream"]
    if not isinstance(refs, list) or not refs or not all(isinstance(r, str) and r.strip() for r in refs):
        _fail(where, "upstream", f"expected a non-empty list of strings, got {refs!r}", source)
    if not isinstance(entry["silent"], bool):
        _fail(where, "silent", f"expected true or false, got {entry['silent']!r}", source)
    _check_status(entry, where, fix_ids, source)
    if "note" in entry:
        _check_text(entry, where, "note", source)


def _check_unique(entries, source: str, seen: dict) -> None:
    """Each id once across every file: ``seen`` maps an id to where it was first (``file entry N``)."""
    for index, entry in enumerate(entries):
        if entry["id"] in seen:
            _fail(_where(entry, index), "id", f"duplicate id (also {seen[entry['id']]})", source)
        seen[entry["id"]] = f"{source} entry {index}"


def validate(data, fix_ids, source: str = CENTRAL) -> List[dict]:
    """The entries of one parsed file whose entries carry their ``fix`` (the central file's, or a
    list with fixes filled in), checked; :class:`KnownBugsError` on the first problem."""
    if not isinstance(data, dict) or not isinstance(data.get("bugs"), list):
        raise KnownBugsError(f"{source}: expected an object with a list 'bugs'")
    for index, entry in enumerate(data["bugs"]):
        check_entry(entry, index, fix_ids, source)
    _check_unique(data["bugs"], source, {})
    return data["bugs"]


def _read(path: str, source: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise KnownBugsError(f"{source}: not valid JSON: {exc}") from None


def _with_fix(entry: dict, fix_id: str) -> dict:
    """The entry with ``fix`` filled in, right after ``status`` (where the files had it)."""
    out = {}
    for key, value in entry.items():
        out[key] = value
        if key == "status":
            out["fix"] = fix_id
    out.setdefault("fix", fix_id)
    return out


def _fix_entries(data, fix_id: str, fix_ids, source: str) -> List[dict]:
    """One fix's file: every entry fixed or guarded, without a ``fix`` field; returned filled in."""
    if not isinstance(data, dict) or not isinstance(data.get("bugs"), list):
        raise KnownBugsError(f"{source}: expected an object with a list 'bugs'")
    out = []
    for index, entry in enumerate(data["bugs"]):
        if isinstance(entry, dict):
            if "fix" in entry:
                _fail(_where(entry, index), "fix", "not used in a fix's folder (the folder names the fix)", source)
            if entry.get("status") not in FIX_STATUSES:
                _fail(
                    _where(entry, index),
                    "status",
                    f"{entry.get('status')!r} in a fix's folder, which holds only entries its fix covers "
                    f"({' or '.join(FIX_STATUSES)}; others belong in {CENTRAL})",
                    source,
                )
            entry = _with_fix(entry, fix_id)
        check_entry(entry, index, fix_ids, source)
        out.append(entry)
    return out


def _central_entries(data, fix_ids) -> List[dict]:
    """The central file: every entry that no fix covers."""
    if isinstance(data, dict) and isinstance(data.get("bugs"), list):
        for index, entry in enumerate(data["bugs"]):
            if isinstance(entry, dict) and entry.get("status") in FIX_STATUSES:
                fix = entry.get("fix")
                folder = fix.replace("-", "_") if isinstance(fix, str) and fix in fix_ids else "<fix>"
                _fail(
                    _where(entry, index),
                    "status",
                    f"{entry['status']!r}: an entry a fix covers belongs in fixes/{folder}/{FIX_FILE}",
                )
    return validate(data, fix_ids, CENTRAL)


def _stray_files(fixes_dir: str, fix_ids) -> None:
    """A ``bugs.json`` in a folder that is no fix of ORDER would be ignored: an error instead."""
    folders = {f.replace("-", "_") for f in fix_ids}
    names = sorted(os.listdir(fixes_dir)) if os.path.isdir(fixes_dir) else []
    for name in names:
        if name not in folders and os.path.isfile(os.path.join(fixes_dir, name, FIX_FILE)):
            raise KnownBugsError(
                f"fixes/{name}/{FIX_FILE}: {name.replace('_', '-')!r} is not a fix of this package "
                f"({', '.join(fix_ids)})"
            )


def load(path: Optional[str] = None, fixes_dir: Optional[str] = None) -> List[dict]:
    """Every catalogued bug, validated against this package's fix ids: each fix's entries
    (``<fixes_dir>/<fix>/bugs.json``, fixes in ORDER, ``fix`` filled in), then the central file's
    (``path``). Defaults: :data:`PATH`, :data:`FIXES_DIR`."""
    from .fixes import ORDER

    path = path or PATH
    fixes_dir = fixes_dir or FIXES_DIR
    _stray_files(fixes_dir, ORDER)
    bugs, seen = [], {}
    for fix_id in ORDER:
        source = f"fixes/{fix_id.replace('-', '_')}/{FIX_FILE}"
        file = os.path.join(fixes_dir, fix_id.replace("-", "_"), FIX_FILE)
        if not os.path.isfile(file):
            continue
        entries = _fix_entries(_read(file, source), fix_id, ORDER, source)
        _check_unique(entries, source, seen)
        bugs += entries
    central = _central_entries(_read(path, os.path.basename(path)), ORDER)
    _check_unique(central, CENTRAL, seen)
    return bugs + central


def affecting(version, bugs: Optional[List[dict]] = None, probed: Optional[Dict[str, str]] = None) -> List[dict]:
    """The entries whose ``affected`` range contains ``version`` (a string or packaging Version).

    ``probed``: on a source checkout, whose version string may name a release its code does not
    match, ``{fix id: state}`` as ``status`` reports it: an entry a fix covers affects the tree when
    that fix's probe found the bug (``applied``) and not when it found the tree fixed
    (``not-needed``); entries without a fix, or whose fix did not judge (disabled, left alone),
    follow the range."""
    from packaging.specifiers import SpecifierSet

    bugs = load() if bugs is None else bugs
    probed = probed or {}

    def affects(bug):
        state = probed.get(bug.get("fix"))
        if state in ("applied", "not-needed"):
            return state == "applied"
        return SpecifierSet(bug["affected"]).contains(str(version), prereleases=True)

    return [b for b in bugs if affects(b)]


def summary(version, bugs: Optional[List[dict]] = None, probed: Optional[Dict[str, str]] = None) -> Dict[str, int]:
    """How many catalogued bugs affect ``version``, per status (every status present, in order)."""
    counts = {s: 0 for s in STATUSES}
    for bug in affecting(version, bugs, probed):
        counts[bug["status"]] += 1
    return counts


def status_line(version, bugs: Optional[List[dict]] = None, probed: Optional[Dict[str, str]] = None) -> str:
    """The line ``status`` prints; ``version`` None when no Megatron-Core version is known;
    ``probed`` on a checkout (:func:`affecting`)."""
    bugs = load() if bugs is None else bugs
    head = f"known bugs: {len(bugs)} catalogued"
    if version is None:
        return f"{head} (docs/known-bugs.md)"
    counts = summary(version, bugs, probed)
    parts = ", ".join(f"{n} {s.replace('-', ' ')}" for s, n in counts.items())
    what = f"this checkout ({version}, by the probes' verdicts)" if probed else f"Megatron-Core {version}"
    return f"{head}, {sum(counts.values())} affect {what}: {parts} (docs/known-bugs.md)"
