"""hybrid-optimizer-common-state as Megatron-Core would carry it: in
``megatron/core/dist_checkpointing/strategies/common.py`` the helpers that run a ``torch.load`` with
the hybrid optimizer's classes allowed (their text taken from runtime/core.py's replacement section,
the code the monkeypatch runs), above the common-state load, and that load's ``torch.load`` call(s)
made through them: a minimal edit of the release's own lines (runtime/core.py wraps the whole
load, which is those calls). tests/patches runs the same round trips with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace, insert_before, replacement_section

TARGET = "megatron/core/dist_checkpointing/strategies/common.py"
# Where the load is: a module function from 0.17.0 on, a strategy's method before.
_FUNCTION = "def load_common(checkpoint_dir: str):\n"
_STRATEGY = "class TorchCommonLoadStrategy(LoadCommonStrategy):\n"
# The loads of common.pt, per release: the loader each ``return <loader>(load_path, ...)`` calls.
_LOADERS = {"0.19": ("maybe_msc.torch.load",), "older": ("msc.torch.load", "torch.load")}
_ARGS = "(load_path, map_location='cpu')"


def _helpers() -> str:
    from ..runtime import core

    return replacement_section(core).lstrip("\n").rstrip("\n") + "\n\n\n"


def source_edits(release: str) -> list:
    before = _STRATEGY if release.startswith(("0.14.", "0.15.", "0.16.")) else _FUNCTION
    loaders = _LOADERS["0.19" if release.startswith("0.19.") else "older"]
    edits = [insert_before(TARGET, before, _helpers())]
    for loader in loaders:
        new = f"return _allowing_optimizer_classes({loader}, load_path, map_location='cpu')"
        edits.append(Replace(TARGET, f"return {loader}{_ARGS}", new))
    return edits
