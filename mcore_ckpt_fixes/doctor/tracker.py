"""The tracker file (``latest_checkpointed_iteration.txt``) against the ``iter_*`` directories.

Megatron reads the tracker to pick the directory (``iter_{:07d}``, or ``release``). A missing tracker
does not fail: ``load_checkpoint`` warns "could not find the metadata file" and the run starts from
scratch, silently, which is why a checkpoint root without one is a problem here.
"""

from __future__ import annotations

import os
import re
from typing import List, Optional, Tuple

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iteration_dirname(iteration: Optional[int]) -> str:
    """Megatron's directory name for ``iteration`` (None: the ``release`` directory)."""
    return "release" if iteration is None else "iter_{:07d}".format(iteration)


def parse_dirname(name: str) -> Tuple[bool, Optional[int]]:
    """(is an iteration directory, its iteration: None for ``release``)."""
    if name == "release":
        return True, None
    m = _ITER_RE.match(name)
    return (True, int(m.group(1))) if m else (False, None)


def iterations_on_disk(root: str, names: List[str]) -> List[int]:
    out = []
    for name in names:
        ok, it = parse_dirname(name)
        if ok and it is not None and os.path.isdir(os.path.join(root, name)):
            out.append(it)
    return sorted(out)


def read_tracker(root: str) -> Tuple[Optional[str], Optional[int], bool, Optional[str]]:
    """(raw text or None when absent, iteration, release, error) as Megatron's read_metadata parses it."""
    path = os.path.join(root, TRACKER)
    try:
        with open(path, "r") as f:
            text = f.read(4096).strip()
    except FileNotFoundError:
        return None, None, False, None
    except (OSError, UnicodeDecodeError) as exc:
        return "", None, False, f"cannot read {TRACKER}: {exc}"
    try:
        iteration = int(text)
    except ValueError:
        if text == "release":
            return text, None, True, None
        return (
            text,
            None,
            False,
            (
                f"{TRACKER} holds {text!r}: Megatron accepts an integer iteration or 'release' and exits on anything else"
            ),
        )
    if iteration < 0:
        return text, None, False, f"{TRACKER} holds {iteration}: Megatron requires an iteration >= 0"
    return text, iteration, False, None


# What a torch_dist / DCP save writes last: the coordinator's .metadata once every rank's data is
# written, then metadata.json (Megatron's sharded_backend record); the tracker after both.
_DATA = re.compile(r"^__(\d+)_\d+\.distcp$")


def unfinished_save(path: str) -> Optional[str]:
    """What an iteration directory newer than the tracker lacks, in one phrase, or None where it is
    a finished distributed save (the tracker alone was not updated) or not one at all."""
    try:
        names = os.listdir(path)
    except OSError:
        return "unreadable"
    ranks = sorted({int(m.group(1)) for m in map(_DATA.match, names) if m})
    missing = [name for name in (".metadata", "metadata.json") if name not in names]
    if not missing:
        return None
    if not ranks and not any(n.startswith("mp_rank_") for n in names):
        return f"incomplete: empty of checkpoint files (no {', no '.join(missing)})"
    data = f"data files of {len(ranks)} rank{'s' * (len(ranks) != 1)}" if ranks else "legacy mp_rank_* files"
    return f"incomplete: {data}, no {', no '.join(missing)} (the save stopped before its coordinator finished)"
