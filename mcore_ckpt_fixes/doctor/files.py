"""The files a load would open: readable, whole containers, and walked with the allow-list
unpickler (see torchfile), without reading a tensor payload.

A damaged or unreadable file is a problem naming it: the load of every rank that opens it fails.
A pickle that names a callable outside the allow-list is the most important thing the doctor can
say: Megatron loads these files with ``torch.load(weights_only=False)`` (and DCP's ``.metadata``
with ``pickle.load``), which would call it. The doctor never does: the walk stops at the name.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple

from . import safe_pickle, torchfile

UNPICKLED_BY = "Megatron's load unpickles it with torch.load(weights_only=False)"


def unsafe_pickle(report, rel: str, exc: safe_pickle.UnsafeGlobal, how: str = UNPICKLED_BY) -> dict:
    return report.problem(
        "unsafe-pickle",
        f"{rel}: its pickle calls {exc.qualname}, which is not on the doctor's allow-list (not run here); "
        f"{how}, which would run it",
        file=rel,
        callable=exc.qualname,
    )


def read_torch_file(report, ckdir: str, rel: str) -> Tuple[Optional[Any], Optional[str]]:
    """(stand-in object of ``ckdir/rel``, a torch.save file; or None and why). An unsafe pickle is a
    problem in ``report``."""
    path = os.path.join(ckdir, rel)
    try:
        obj, nbytes = torchfile.read_file(path)
    except safe_pickle.UnsafeGlobal as exc:
        unsafe_pickle(report, rel, exc)
        return None, str(exc)
    except torchfile.Damaged as exc:
        damaged(report, rel, str(exc))
        return None, str(exc)
    except OSError as exc:
        unreadable(report, rel, exc)
        return None, str(exc.strerror or exc)
    except Exception as exc:  # a malformed pickle raises almost anything; never a traceback
        damaged(report, rel, f"its pickle is corrupt ({type(exc).__name__}: {exc})")
        return None, f"{type(exc).__name__}: {exc}"
    report.bytes_read += nbytes
    return obj, None


def damaged(report, rel: str, why: str) -> dict:
    return report.problem("damaged-file", f"{rel}: {why}", file=rel)


def unreadable(report, rel: str, exc: OSError) -> dict:
    return report.problem(
        "unreadable-file",
        f"{rel} cannot be opened: {exc.strerror or exc} (the load of every rank that needs it fails the same way)",
        file=rel,
    )


def check_openable(report, ckdir: str, rel: str) -> bool:
    """Open and close ``ckdir/rel`` (no byte read): permissions, and a file rather than a directory."""
    try:
        with open(os.path.join(ckdir, rel), "rb"):
            return True
    except OSError as exc:
        unreadable(report, rel, exc)
        return False


def read_torch_blob(report, where: str, data: bytes) -> Tuple[Optional[Any], Optional[str]]:
    """As :func:`read_torch_file` for a byte object read out of a DCP data file."""
    try:
        return torchfile.read_bytes(data), None
    except safe_pickle.UnsafeGlobal as exc:
        unsafe_pickle(report, where, exc, "DCP's load unpickles it with torch.load(weights_only=False)")
        return None, str(exc)
    except torchfile.Damaged as exc:
        damaged(report, where, str(exc))
        return None, str(exc)
    except Exception as exc:
        damaged(report, where, f"its pickle is corrupt ({type(exc).__name__}: {exc})")
        return None, f"{type(exc).__name__}: {exc}"
