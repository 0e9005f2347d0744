"""The catalogue of known checkpoint bugs of the supported Megatron-Core releases (``known_bugs.json``).

Each entry names a bug a user can meet on save or resume, the releases it affects and what this
package does about it: ``fixed`` or ``guarded`` by one of its fixes, ``open`` (reproduced here, no fix
yet), ``not-in-scope`` (why) or ``not-reproduced`` (how it was tried). ``status`` prints how many affect
the running release; docs/known-bugs.md is generated from the same file by tools/docs.py.

The data is JSON, not TOML: ``tomllib`` exists from Python 3.11 only and the package supports 3.10, and
a hand-written TOML reader for 3.10 would be a code path that no test line (3.11, 3.12) exercises.

Nothing here is imported by ``import mcore_ckpt_fixes``: the file is read on first use.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "known_bugs.json")
# The order ``status`` and the docs count them in.
STATUSES = ("fixed", "guarded", "open", "not-in-scope", "not-reproduced")
# Per status, the field that must say more: the fix's id, how it was reproduced or tried, or why not.
DETAIL = {"fixed": "fix", "guarded": "fix", "open": "how", "not-in-scope": "why", "not-reproduced": "how"}
REQUIRED = ("id", "symptom", "affected", "upstream", "status", "silent")
OPTIONAL = ("fix", "how", "why", "note")


class KnownBugsError(ValueError):
    """The catalogue is malformed: one line naming the entry and the field."""


def _fail(where: str, field: str, problem: str) -> None:
    raise KnownBugsError(f"known_bugs.json: {where}: field {field!r}: {problem}")


def _check_text(entry: dict, where: str, field: str) -> None:
    value = entry.get(field)
    if not isinstance(value, str) or not value.strip():
        _fail(where, field, f"expected a non-empty string, got {value!r}")


def _check_affected(entry: dict, where: str) -> None:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    _check_text(entry, where, "affected")
    try:
        SpecifierSet(entry["affected"])
    except InvalidSpecifier as exc:
        _fail(where, "affected", f"not a PEP 440 specifier set ({exc})")


def _check_status(entry: dict, where: str, fix_ids) -> None:
    status = entry.get("status")
    if status not in STATUSES:
        _fail(where, "status", f"{status!r} is not one of {', '.join(STATUSES)}")
    detail = DETAIL[status]
    _check_text(entry, where, detail)
    for other in ("fix", "how", "why"):
        if other != detail and other in entry:
            _fail(where, other, f"not used with status {status!r} (which takes {detail!r})")
    if detail == "fix" and entry["fix"] not in fix_ids:
        _fail(where, "fix", f"{entry['fix']!r} is not a fix of this package ({', '.join(fix_ids)})")


def check_entry(entry, index: int, fix_ids) -> None:
    """Raise :class:`KnownBugsError` for the first problem of one entry."""
    where = f"entry {index}"
    if not isinstance(entry, dict):
        _fail(where, "-", f"expected an object, got {type(entry).__name__}")
    if isinstance(entry.get("id"), str) and entry["id"]:
        where = f"entry {index} ({entry['id']})"
    for field in REQUIRED:
        if field not in entry:
            _fail(where, field, "missing")
    unknown = sorted(set(entry) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        _fail(where, unknown[0], f"unknown field (known: {', '.join(REQUIRED + OPTIONAL)})")
    for field in ("id", "symptom"):
        _check_text(entry, where, field)
    _check_affected(entry, where)
    refs = entry["upstream"]
    if not isinstance(refs, list) or not refs or not all(isinstance(r, str) and r.strip() for r in refs):
        _fail(where, "upstream", f"expected a non-empty list of strings, got {refs!r}")
    if not isinstance(entry["silent"], bool):
        _fail(where, "silent", f"expected true or false, got {entry['silent']!r}")
    _check_status(entry, where, fix_ids)
    if "note" in entry:
        _check_text(entry, where, "note")


def validate(data, fix_ids) -> List[dict]:
    """The entries of a parsed catalogue, checked; :class:`KnownBugsError` on the first problem."""
    if not isinstance(data, dict) or not isinstance(data.get("bugs"), list):
        raise KnownBugsError("known_bugs.json: expected an object with a list 'bugs'")
    seen = set()
    for index, entry in enumerate(data["bugs"]):
        check_entry(entry, index, fix_ids)
        if entry["id"] in seen:
            _fail(f"entry {index} ({entry['id']})", "id", "duplicate id")
        seen.add(entry["id"])
    return data["bugs"]


def load(path: Optional[str] = None) -> List[dict]:
    """Every catalogued bug, validated against this package's fix ids."""
    from .fixes import ORDER

    path = path or PATH
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise KnownBugsError(f"{os.path.basename(path)}: not valid JSON: {exc}") from None
    return validate(data, ORDER)


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
