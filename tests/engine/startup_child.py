"""Child of tests/engine/test_startup.py: applies every fix as ``status`` does (every target module
imported, each probe run) under an audit hook that records each write to the file system made
while a frame of this package is on the stack; prints them, and each fix's state, as JSON."""

import json
import os
import sys
import sysconfig

PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep + "mcore_ckpt_fixes"
WRITES = []
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
EVENTS = {"os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.symlink", "os.link", "os.truncate"}


STDLIB = sysconfig.get_paths()["stdlib"]


def _from_package():
    """Whether the innermost caller outside the standard library is this package (a write
    Megatron's or torch's own import makes is theirs, with or without the fixes)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE):
            return True
        if not (name.startswith(STDLIB) or name.startswith("<")):
            return False
        frame = frame.f_back
    return False


def hook(event, args):
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and any(c in mode for c in "wax+")) or (mode is None and flags & WRITE_FLAGS)
        if writes and _from_package():
            WRITES.append([event, str(path)])
    elif event in EVENTS and _from_package():
        WRITES.append([event, str(args[0])])


if __name__ == "__main__":
    sys.addaudithook(hook)
    import mcore_ckpt_fixes
    from mcore_ckpt_fixes.cli.status import import_targets

    import_targets()
    states = {r["id"]: r["state"] for r in mcore_ckpt_fixes.report()}
    print(json.dumps({"writes": WRITES, "states": states}))
