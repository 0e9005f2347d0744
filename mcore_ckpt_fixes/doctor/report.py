"""The doctor's findings: a dict for ``--json`` (the contract other tools read) and a text rendering."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from . import remedies


class Unreadable(Exception):
    """The input cannot be read at all (exit 2): one line naming what and why."""


class Report:
    """What ``inspect`` found. ``data`` is the JSON object; ``problems`` are ``{code, message, remedy}``
    dicts (remedy: the next step, see remedies)."""

    def __init__(self, path: str):
        self.data: Dict[str, Any] = {"path": path, "format": "unknown", "iteration": None, "problems": []}
        self.notes: List[str] = []
        self.bytes_read = 0

    # -- building -------------------------------------------------------------------------------
    def __setitem__(self, key, value):
        self.data[key] = value

    def __getitem__(self, key):
        return self.data[key]

    def get(self, key, default=None):
        return self.data.get(key, default)

    def problem(self, code: str, message: str, remedy: Optional[str] = None, **extra) -> dict:
        """Record a finding; ``remedy`` (the next step) defaults to the one for its code."""
        entry = {"code": code, "message": message, "remedy": remedy or remedies.for_code(code), **extra}
        self.data["problems"].append(entry)
        return entry

    def note(self, text: str) -> None:
        self.notes.append(text)

    # -- reading --------------------------------------------------------------------------------
    @property
    def problems(self) -> List[dict]:
        return self.data["problems"]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> Dict[str, Any]:
        out = dict(self.data)
        out["notes"] = list(self.notes)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def render(self) -> str:
        d = self.data
        lines = [f"checkpoint: {d.get('checkpoint_dir') or d['path']}"]
        tr = d.get("tracker")
        if tr is not None:
            lines.append(f"tracker:    {tr['summary']}")
        it = d.get("iteration")
        lines.append(f"iteration:  {'release' if d.get('release') else it if it is not None else '-'}")
        lines.append(f"format:     {d['format']}" + (f" ({d['format_reason']})" if d.get("format_reason") else ""))
        sizes = d.get("sizes")
        if sizes is not None:
            lines.append(
                "sizes:      "
                + (_sizes_line(sizes) or "none readable from the checkpoint's saved args (give --tp/--pp/--ep)")
            )
        if "layout" in d:
            lines.append(f"layout:     {d['layout']}: {d['layout_reason']}")
            lines.append(f"loader:     {d['loader']}: {d['loader_reason']}")
            lines.append(f"expected:   {_names(d.get('expected'))}")
            lines.append(f"on disk:    {_names(d.get('on_disk'))}")
            lines.append(f"missing:    {_names(d.get('missing')) or '-'}")
            lines.append(f"extra:      {_names(d.get('extra')) or '-'}")
        if "tensors" in d:
            lines.append(f"tensors:    {d['tensors']} tensors in {d['chunks']} chunks, {d['objects']} byte objects")
            if d.get("common_state"):
                lines.append(f"common:     {d['common_state']}")
            if d.get("rng_layout"):
                lines.append(f"rng:        {d['rng_layout']}")
            if d.get("experts"):
                lines.append(f"experts:    {d['experts']}")
            if "readable_by" in d:
                rb = ", ".join(d["readable_by"]) or "none"
                lines.append(f"readable by Megatron-Core: {rb} ({d.get('readable_by_reason', '')})")
        if d.get("integrity"):
            lines.append(f"integrity:  {d['integrity']['file']}: {d['integrity'].get('summary', '')}")
        for n in self.notes:
            lines.append(f"note: {n}")
        if self.problems:
            lines.append(f"{len(self.problems)} problem(s):")
            for p in self.problems:
                lines.append(f"  [{p['code']}] {p['message']}")
                if p.get("remedy"):
                    lines.append(f"      next: {p['remedy']}")
        else:
            lines.append("no problems found")
        return "\n".join(lines)


def _names(names: Optional[List[str]], limit: int = 8) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _sizes_line(sizes: Dict[str, dict]) -> str:
    """``tp=2 pp=1 (given)  ep=2 (saved args in common.pt)``: each source said once."""
    groups: Dict[str, List[str]] = {}
    for dim, v in sizes.items():
        if v.get("used") is not None:
            groups.setdefault(v["source"], []).append(f"{dim}={v['used']}")
    return "  ".join(f"{' '.join(dims)} ({source})" for source, dims in groups.items())
