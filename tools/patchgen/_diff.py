"""What every tools/patchgen/<fix>.py shares: read a pristine file, apply the fix's edit, print the
unified diff (``a/`` and ``b/`` prefixes, so ``patch -p1`` applies it in site-packages or a checkout)."""

from __future__ import annotations

import difflib
import os
import re
import sys


def write_diff(src_root: str, rel_path: str, edit) -> None:
    """Print the diff that ``edit(text) -> text`` makes to ``src_root/rel_path``."""
    with open(f"{src_root}/{rel_path}", encoding="utf-8") as f:
        before = f.read()
    after = edit(before)
    sys.stdout.writelines(
        difflib.unified_diff(
            before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{rel_path}", f"b/{rel_path}"
        )
    )


def replace_between(text: str, start: str, stop: str, code: str, where: str) -> str:
    """``text`` with everything from ``start`` up to (not including) ``stop`` replaced by ``code``;
    each anchor must occur exactly once, or the release is not the one the diff was written for."""
    if text.count(start) != 1 or text.count(stop) != 1:
        raise SystemExit(f"patchgen: {where}: anchors {start!r} / {stop!r} not found exactly once")
    i, j = text.index(start), text.index(stop)
    return text[:i] + code + text[j:]


FIXES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "mcore_ckpt_fixes", "fixes")
BEGIN, END = "# -- replacement ---", "# -- end of replacement ---"


def replacement_section(fix_file: str) -> str:
    """The code between a fix module's "replacement" markers, without the marker comment block
    (it speaks of the fix module): the part a diff carries verbatim, so the two cannot drift."""
    with open(os.path.join(FIXES, fix_file), encoding="utf-8") as f:
        text = f.read()
    body = text[text.index(BEGIN) : text.index(END)]
    return body[body.index("\n\n") + 2 :]


def refuse_fix_names(code: str, names) -> None:
    """A diff must not refer to names that exist only in the fix module."""
    for name in names:
        if re.search(rf"\b{name}\b", code):
            raise SystemExit(f"patchgen: the replacement still refers to the fix module's {name!r}")
