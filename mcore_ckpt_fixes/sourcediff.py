"""Source diffs of the fixes: where a fix's upstream-shaped code goes in a release's own file.

Every ``patches/<fix>/<release>.patch`` is written one way: the fix's ``diff/`` modules hold the
code the diff carries, written as upstream would, one module per target (``diff/core.py`` for
Megatron-Core, ``diff/<framework>.py`` for a framework's own copy of the code); that module's
``source_edits(release)`` lists the :class:`Edit` s for the release (:func:`fix_edits` finds it), and
:func:`render` applies them to the pristine file and prints the unified diff (``a/`` and ``b/``
prefixes: ``patch -p1`` in site-packages or a checkout).

    python tools/patchgen FIX_ID SRC_ROOT RELEASE > patches/FIX_ID/RELEASE.patch

Every anchor must occur exactly as often as the edit says, or the release is not the one the diff
was written for and generation stops with the anchor named. Nothing here imports torch or megatron.
"""

from __future__ import annotations

import difflib
import os
import re


class PatchgenError(SystemExit):
    def __init__(self, message):
        super().__init__(f"patchgen: {message}")


class Edit:
    """One change to ``path`` (relative to the source root). ``optional``: skip the edit when the
    file is absent (``megatron/training`` ships in the wheel only from 0.17)."""

    def __init__(self, path, optional=False):
        self.path, self.optional = path, optional

    def apply(self, text: str) -> str:
        raise NotImplementedError


class Replace(Edit):
    """``old`` -> ``new``, ``old`` found exactly once; with ``every=True`` at every occurrence, and
    ``{indent}`` in ``new`` becomes the indentation of the line ``old`` starts on."""

    def __init__(self, path, old, new, every=False, optional=False):
        super().__init__(path, optional)
        self.old, self.new, self.every = old, new, every

    def apply(self, text):
        count = text.count(self.old)
        if count == 0 or (count != 1 and not self.every):
            raise PatchgenError(
                f"{self.path}: anchor found {count} times (need {'1+' if self.every else 1}): {self.old!r}"
            )
        out, pos = [], 0
        while True:
            at = text.find(self.old, pos)
            if at < 0:
                out.append(text[pos:])
                return "".join(out)
            indent = text[text.rfind("\n", 0, at) + 1 : at]
            out.append(text[pos:at] + self.new.replace("{indent}", indent))
            pos = at + len(self.old)


def insert_before(path, anchor, code, optional=False):
    return Replace(path, anchor, code + anchor, optional=optional)


def insert_after(path, anchor, code, optional=False):
    return Replace(path, anchor, anchor + code, optional=optional)


class ReplaceBetween(Edit):
    """Everything from ``start`` up to (not including) ``stop`` becomes ``code``; each anchor once."""

    def __init__(self, path, start, stop, code, optional=False):
        super().__init__(path, optional)
        self.start, self.stop, self.code = start, stop, code

    def apply(self, text):
        if text.count(self.start) != 1 or text.count(self.stop) != 1:
            raise PatchgenError(f"{self.path}: anchors {self.start!r} / {self.stop!r} not found exactly once")
        i, j = text.index(self.start), text.index(self.stop)
        return text[:i] + self.code + text[j:]


class Transform(Edit):
    """A change computed from the whole file (``func(text) -> text``), for edits that depend on
    what the release's function looks like (anchors searched inside one function only)."""

    def __init__(self, path, func, optional=False):
        super().__init__(path, optional)
        self.func = func

    def apply(self, text):
        return self.func(text)


def render(src_root: str, edits) -> str:
    """The unified diff ``edits`` make to the files under ``src_root``, files in first-edit order."""
    order, by_path = [], {}
    for edit in edits:
        if edit.path not in by_path:
            order.append(edit.path)
            by_path[edit.path] = []
        by_path[edit.path].append(edit)
    out = []
    for path in order:
        full = os.path.join(src_root, path)
        if not os.path.exists(full):
            if all(e.optional for e in by_path[path]):
                continue
            raise PatchgenError(f"{path} is not in {src_root}")
        with open(full, encoding="utf-8") as f:
            before = f.read()
        after = before
        for edit in by_path[path]:
            after = edit.apply(after)
        out.extend(
            difflib.unified_diff(
                before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{path}", f"b/{path}"
            )
        )
    return "".join(out)


BEGIN, END = "# -- replacement ---", "# -- end of replacement ---"


def replacement_section(module) -> str:
    """The code between ``module``'s "replacement" markers, without the marker comment block (it
    speaks of the fix): the part a diff carries verbatim, so the monkeypatch and the diff cannot drift."""
    with open(module.__file__, encoding="utf-8") as f:
        text = f.read()
    body = text[text.index(BEGIN) : text.index(END)]
    return body[body.index("\n\n") + 2 :]


def refuse_names(code: str, names) -> str:
    """``code``, after checking it refers to none of ``names`` (names that exist only in the fix)."""
    for name in names:
        if re.search(rf"\b{name}\b", code):
            raise PatchgenError(f"the replacement still refers to the fix's {name!r}")
    return code


def fix_edits(fix_id: str, release: str) -> list:
    """The edits of ``fix_id``'s diff for ``release``, found by the runtime's naming: a Megatron-Core
    release from the fix's ``diff/core.py``, ``<dist>-<version>`` (a framework's own copy of the
    code) from ``diff/<short name>.py`` (``megatron-bridge-0.6.2``: ``diff/bridge.py``)."""
    import importlib.util

    from .engine.fix import runtime_module

    dist, _, version = release.rpartition("-")
    home = f"mcore_ckpt_fixes.fixes.{fix_id.replace('-', '_')}.diff"
    name = f"{home}.{runtime_module(dist or 'megatron-core')}"
    try:
        found = importlib.util.find_spec(name)
    except ModuleNotFoundError:  # no such fix
        found = None
    if found is None:
        raise PatchgenError(f"{fix_id} has no source diff for {release!r} (no module {name})")
    return importlib.import_module(name).source_edits(version if dist else release)
