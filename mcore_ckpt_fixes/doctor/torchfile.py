"""What ``torch.load`` would find in a file, checked without reading a tensor payload or running code.

Two containers reach ``torch.load`` in a Megatron checkpoint (``model_optim_rng.pt``,
``distrib_optim.pt``, ``common.pt``, and the byte objects inside ``.distcp`` files):

* the zip archive of ``torch.save`` (the default since torch 1.6): its end record and central
  directory are read (``zipfile`` does that), each member's stored size is checked against where the
  next record starts, and only the pickle record (``data.pkl``, CRC-checked) is read; the ``data/N``
  tensor storages are never opened;
* anything else is a raw pickle stream, as the old non-zip ``torch.save`` writes it (magic number,
  protocol, sys info, the object, the storage keys, then each storage as an int64 element count and
  its bytes). ``torch.load`` unpickles the first object before it looks at the magic number, so a
  pickle planted there runs even though the load then fails. The pickles are walked with the
  allow-list unpickler; each storage's 8-byte count is read and its bytes are skipped with a seek.

Failures are :class:`Damaged` (the container is cut or corrupt: the message says what torch would
hit) or :class:`safe_pickle.UnsafeGlobal` (the pickle names a callable outside the allow-list).
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from typing import Any, BinaryIO, Dict, Tuple

from . import safe_pickle

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
LEGACY_PROTOCOL = 1001
_LOCAL_HEADER = 30  # fixed part of a zip local file header; the name and extra field follow
# Bytes per element of the storage types an old torch.save names in its persistent ids.
_ELEMENT_SIZE = {
    "Double": 8,
    "Float": 4,
    "Half": 2,
    "BFloat16": 2,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
    "ComplexFloat": 8,
    "ComplexDouble": 16,
    "Untyped": 1,
    "QInt8": 1,
    "QUInt8": 1,
    "QInt32": 4,
}


class Damaged(Exception):
    """The file is not a whole torch.save container: what is wrong, in words torch's failure echoes."""


def read_file(path: str) -> Tuple[Any, int]:
    """(the unpickled stand-in object, bytes read) for the file ``path``."""
    with open(path, "rb") as raw:
        f = _Counting(raw)
        obj = read_stream(f, os.fstat(raw.fileno()).st_size)
        return obj, f.count


def read_bytes(data: bytes) -> Any:
    """As :func:`read_file` for a torch.save blob held in memory (a DCP byte object)."""
    return read_stream(io.BytesIO(data), len(data))


class _Counting:
    """A file that counts the bytes read through it (what the doctor reports as read)."""

    def __init__(self, f):
        self._f, self.count = f, 0

    def read(self, n=-1):
        data = self._f.read(n)
        self.count += len(data)
        return data

    def readline(self, n=-1):
        data = self._f.readline(n)
        self.count += len(data)
        return data

    def readinto(self, buf):
        n = self._f.readinto(buf)
        self.count += n or 0
        return n

    def seek(self, *args):
        return self._f.seek(*args)

    def tell(self):
        return self._f.tell()

    def seekable(self):
        return True


def read_stream(f: BinaryIO, size: int) -> Any:
    """The stand-in object of the torch.save container in ``f`` (``size`` bytes long)."""
    if size == 0:
        raise Damaged("empty (0 bytes): torch.load fails with EOFError")
    head = f.read(4)
    f.seek(0)
    if head == b"PK\x03\x04" or _has_zip_end(f, size):
        return _read_zip(f, size)
    if head[:1] != b"\x80":  # every torch.save pickle starts with the PROTO opcode
        raise Damaged(f"neither a torch.save zip archive nor a pickle (starts with {head!r})")
    return _read_legacy(f, size)


def _has_zip_end(f: BinaryIO, size: int) -> bool:
    f.seek(max(0, size - 22))
    found = b"PK\x05\x06" in f.read(22)
    f.seek(0)
    return found


def _read_zip(f: BinaryIO, size: int) -> Any:
    try:
        zf = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError) as exc:
        raise Damaged(
            f"a torch.save zip archive cut short or corrupt ({size} bytes, {exc}): torch.load fails "
            "with 'failed finding central directory'"
        ) from None
    with zf:
        members = sorted(zf.infolist(), key=lambda i: i.header_offset)
        _check_member_bounds(members, zf.start_dir)
        records = [i for i in members if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
        if not records:
            raise Damaged("a zip archive without a data.pkl record: not written by torch.save")
        try:
            data = zf.read(records[0])
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            raise Damaged(f"its pickle record {records[0].filename} is corrupt ({exc})") from None
    return safe_pickle.loads(data)


def _check_member_bounds(members, start_dir: int) -> None:
    """Each member's header and stored bytes must end before the next record starts (the local
    header's extra field is not counted: this is a lower bound, read from the central directory)."""
    for i, info in enumerate(members):
        limit = members[i + 1].header_offset if i + 1 < len(members) else start_dir
        end = info.header_offset + _LOCAL_HEADER + len(info.filename.encode()) + info.compress_size
        if end > limit:
            raise Damaged(
                f"member {info.filename} claims {info.compress_size} bytes but the archive has room for "
                f"at most {max(0, limit - (end - info.compress_size))}: torch.load fails reading it"
            )


def _read_legacy(f: BinaryIO, size: int) -> Any:
    """Walk the pickles of an old torch.save stream; seek over the storages, checking their counts."""
    storages: Dict[Any, Tuple[Any, Any]] = {}
    first = _load_one(f, storages)
    if first != LEGACY_MAGIC:
        raise Damaged(
            "a raw pickle, not a torch.save file: torch.load unpickles it, then fails with "
            "'Invalid magic number; corrupt file?'"
        )
    if _load_one(f, storages) != LEGACY_PROTOCOL:
        raise Damaged("an old torch.save stream with an unknown protocol version")
    _load_one(f, storages)  # sys info
    obj = _load_one(f, storages)
    keys = _load_one(f, storages)
    for key in keys if isinstance(keys, list) else ():
        storage_type, numel = storages.get(key, (None, None))
        count = f.read(8)
        if len(count) < 8:
            raise Damaged(
                f"an old torch.save stream cut short at {size} bytes: storage {key} is missing "
                "(torch.load fails with 'unexpected EOF')"
            )
        (n,) = struct.unpack("<q", count)
        width = _element_size(storage_type)
        if numel is not None and n != numel:
            raise Damaged(f"storage {key} holds {n} elements where the pickle says {numel}: corrupt")
        end = f.tell() + n * (width or 1)
        if end > size:
            raise Damaged(
                f"an old torch.save stream cut short: storage {key} needs bytes up to {end}, the file has "
                f"{size} (torch.load fails with 'unexpected EOF')"
            )
        f.seek(end)
    return obj


def _element_size(storage_type) -> int:
    name = str(storage_type or "")
    name = name.rsplit(".", 1)[-1]
    return _ELEMENT_SIZE.get(name[: -len("Storage")] if name.endswith("Storage") else name, 0)


def _load_one(f: BinaryIO, storages: Dict[Any, Tuple[Any, Any]]) -> Any:
    unpickler = _RecordingUnpickler(f, storages)
    try:
        return unpickler.load()
    except safe_pickle.UnsafeGlobal:
        raise
    except Exception as exc:  # a cut pickle raises EOFError, UnpicklingError, ValueError, ...
        raise Damaged(f"its pickle is cut short or corrupt ({type(exc).__name__}: {exc})") from None


class _RecordingUnpickler(safe_pickle.SafeUnpickler):
    """The allow-list unpickler that also notes each storage's type and element count (old format)."""

    def __init__(self, f, storages):
        super().__init__(f)
        self._storages = storages

    def persistent_load(self, pid):
        # ('storage', storage_type, key, location, numel, view_metadata) in the old format
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            self._storages[pid[2]] = (pid[1], pid[4])
        return super().persistent_load(pid)
