"""The byte objects of a DCP checkpoint (RNG states, torch_dist's embedded common state, args, ...).

A load hands each one to ``torch.load(weights_only=False)`` (DCP's ``DefaultLoadPlanner.load_bytes``),
so each is read (its byte range only: these are small pickled objects, never tensor payloads) and
walked with the allow-list unpickler. The storage index is scanned once, together with the data
files' extents (see dcp.analyze): at a million chunks a second pass would cost a second.
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

from . import files


def object_ranges(storage) -> Tuple[Dict[str, int], Dict[str, List[Tuple[int, int, str]]]]:
    """(end of the last byte each data file must hold, {file: [(offset, length, fqn)]} of byte objects).

    Byte objects are the index entries without a chunk offset (``MetadataIndex.offset`` None, and then
    left out of its pickled state).
    """
    try:
        return _ranges_fast(storage)
    except (AttributeError, TypeError):  # an index that is not what torch writes: the careful walk
        return _ranges_checked(storage)


def _ranges_fast(storage):
    # Plain attribute access on the stand-ins torch's index always fills: at a million entries every
    # getattr with a default costs a tenth of a second.
    ends: Dict[str, int] = {}
    objects: Dict[str, List[Tuple[int, int, str]]] = {}
    get = ends.get
    for key, info in storage.items():
        rel, offset, length = info.relative_path, info.offset, info.length
        end = offset + length
        if end > get(rel, -1):
            ends[rel] = end
        if key.__dict__.get("offset") is None and not info.__dict__.get("transform_descriptors"):
            objects.setdefault(rel, []).append((offset, length, key.fqn))
    return ends, objects


def _ranges_checked(storage):
    ends: Dict[str, int] = {}
    objects: Dict[str, List[Tuple[int, int, str]]] = {}
    for key, info in storage.items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str):
            continue
        offset = getattr(info, "offset", 0) or 0
        length = getattr(info, "length", 0) or 0
        if not isinstance(offset, int) or not isinstance(length, int):
            continue
        if offset + length > ends.get(rel, -1):
            ends[rel] = offset + length
        if getattr(key, "offset", None) is None and not getattr(info, "transform_descriptors", None):
            objects.setdefault(rel, []).append((offset, length, str(getattr(key, "fqn", "?"))))
    return ends, objects


def read_objects(report, ckdir: str, objects: Dict[str, List[Tuple[int, int, str]]], skip=()) -> Dict[str, object]:
    """{fqn: stand-in object} of every byte object that could be read; unsafe ones are problems.
    Files in ``skip`` (missing or too short, already reported) are not opened."""
    out: Dict[str, object] = {}
    for rel in sorted(objects):
        if rel in skip:
            continue
        try:
            with open(os.path.join(ckdir, rel), "rb") as f:
                for offset, length, fqn in sorted(objects[rel]):
                    f.seek(offset)
                    data = f.read(length)
                    report.bytes_read += len(data)
                    obj, _ = files.read_torch_blob(report, f"{rel} (byte object {fqn})", data)
                    if obj is not None:
                        out[fqn] = obj
        except OSError:
            continue  # the data-file checks report a file that cannot be opened
    return out
