"""DCP's ``.metadata`` read as a stream of pickle opcodes, without building torch's objects.

``.metadata`` is ``pickle.dump(Metadata)``: per tensor a ``TensorStorageMetadata`` whose ``chunks``
are ``ChunkStorageMetadata(offsets, sizes)``, and per chunk or byte object a ``MetadataIndex`` ->
``_StorageInfo(relative_path, offset, length)`` entry of ``storage_data``. At a million chunks the
allow-list unpickler (safe_pickle) builds some four million objects: seconds, and 1.5 GB, most of
it in the unpickler's memo, which keeps every intermediate tuple and state dict alive to the end.

This reader keeps only what the doctor uses: each tensor's shape and chunk boxes (``(offsets,
sizes)`` tuples, equal boxes shared), each data file's extent and the byte objects' ranges. It is a
small pickle machine of its own (protocol 4 and 5, as DCP writes them; its opcodes in
:mod:`.dcp_scan_ops`): every global goes through the same allow-list (safe_pickle.find_safe_global)
and nothing named by the file is imported or called, except the allow-listed stand-ins, exactly as
with safe_pickle. The repeated units (a chunk; a storage entry of a tensor chunk; a ``WriteItem`` of
the ``all_local_plans`` that Megatron-Core's torch_dist save keeps in the index) are matched many at
a time by regular expressions built from the memo references the machine has seen (the class, the
field names, ``torch.Size``), and decoded from the matched bytes. The expressions admit references,
ints, ``None``/bools, names (each checked against its length byte) and ``torch.Size`` by its
reference: no global, no other call, so what they step over cannot hide one. A unit in any other
spelling is run through the machine one opcode at a time.
Anything it does not know (another protocol, an opcode outside the list, a memo reference it did
not keep) raises :class:`Fallback`, and the caller uses safe_pickle instead: slower, same answer.
"""

from __future__ import annotations

import gc
import os
import re
import struct
from bisect import bisect_right
from itertools import accumulate, compress, repeat
from operator import add, eq, itemgetter, mul, rshift
from typing import Dict, List, Optional, Tuple

from . import safe_pickle
from .dcp_scan_ops import OPS, DcpRecord, Fallback


class TensorMeta:
    """A tensor of the index: its global shape and its chunks as ``(offsets, sizes)`` tuples."""

    __slots__ = ("size", "chunks")

    def __init__(self, size, chunks):
        self.size, self.chunks = size, chunks


class BytesMeta:
    """A byte object of the index (no chunks)."""

    __slots__ = ()


class Index:
    """What the doctor needs of DCP's Metadata: ``state_dict_metadata`` ({fqn: TensorMeta | BytesMeta}),
    ``ends`` ({data file: end of its last byte in use}) and ``objects`` ({data file: [(offset,
    length, fqn)]} of byte objects)."""

    __slots__ = ("state_dict_metadata", "ends", "objects")

    def __init__(self, sdm, ends, objects):
        self.state_dict_metadata, self.ends, self.objects = sdm, ends, objects


_DCP_MD = "torch.distributed.checkpoint.metadata."
_DCP_PLANNER = "torch.distributed.checkpoint.planner."
_INT = rb"(?:K.|M..|J....|\x8a\x01.|\x8a\x02..|\x8a\x03...|\x8a\x04....|\x8a\x05.{5}|\x8a\x06.{6}|\x8a\x07.{7}|\x8a\x08.{8})"
# A non-empty tuple of ints as the pickler writes it (TUPLE1..3, else MARK ... TUPLE), memoized.
_INTS = rb"(?:" + _INT + rb"\x85|" + _INT + rb"{2}\x86|" + _INT + rb"{3}\x87|\(" + _INT + rb"{4,}t)\x94"
_INT_RE = re.compile(_INT, re.S)
_REF = rb"(?:h.|j....)"
_STR = rb"\x8c[^\x94]*\x94"  # an inline short string, memoized; its length is checked when decoded


def _ref(idx: int) -> bytes:
    return b"h" + bytes((idx,)) if idx < 256 else b"j" + struct.pack("<I", idx)


def _int(b: bytes) -> int:
    op = b[0]
    if op == 0x4A:  # J: signed 4 bytes
        return int.from_bytes(b[1:], "little", signed=True)
    if op == 0x8A:  # LONG1: n bytes, signed
        return int.from_bytes(b[2:], "little", signed=True)
    return int.from_bytes(b[1:], "little")  # K, M: unsigned


_SHIFT = bytes(16 if i == 0x8A else 8 for i in range(256))  # value bits start after the opcode (and LONG1's length)
_SIGNED = bytes(1 if i in (0x4A, 0x8A) else 0 for i in range(256))  # J and LONG1 are signed
_TOP = bytes(1 if i >= 0x80 else 0 for i in range(256))
_IS_STR = bytes(1 if i == 0x8C else 0 for i in range(256))


def _values(fields) -> list:
    """The non-negative ints of encoded int fields (K, M, J, LONG1), decoded in C loops."""
    ops = bytes(map(itemgetter(0), fields))
    signed = ops.translate(_SIGNED)
    if 1 in signed:  # a J or LONG1 whose top byte has its high bit set is negative: never written by DCP
        top = bytes(map(itemgetter(-1), fields)).translate(_TOP)
        if int.from_bytes(signed, "little") & int.from_bytes(top, "little"):
            raise Fallback("negative offset or length")
    return list(map(rshift, map(int.from_bytes, fields, repeat("little")), ops.translate(_SHIFT)))


def strings_exact(fields) -> bool:
    """Each string field as matched (``\\x8c``, length, bytes up to the first 0x94 = MEMOIZE) is exactly
    as long as its length byte says. Otherwise the expression cut the opcodes differently from an
    unpickler (a name holding a 0x94 byte, or opcodes hidden behind a string with no MEMOIZE after
    it): the whole file is read by the allow-list unpickler instead."""
    return all(map(eq, map(len, fields), map(add, map(itemgetter(1), fields), repeat(3))))


def _spelled(field: bytes) -> str:
    """The string of a SHORT_BINUNICODE field as matched (opcode, length, UTF-8, MEMOIZE)."""
    if len(field) != field[1] + 3:
        raise Fallback("string length")
    return bytes(field[2:-1]).decode("utf-8", "surrogatepass")


def _ints(b: bytes) -> tuple:
    return tuple(_int(m) for m in _INT_RE.findall(b[1:-2] if b[0] == 0x28 else b[:-2]))


def read(f) -> Index:
    """The Index of the ``.metadata`` pickle in the binary file ``f``. Raises Fallback (also for a
    global outside the allow-list: safe_pickle then names it) or ValueError/EOFError (cut)."""
    # A million small tuples and no cycle among them: the cyclic GC would rescan them again and again.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return OpcodeMachine(unframe(f)).run()
    except safe_pickle.UnsafeGlobal as exc:
        # The allow-list unpickler decides: a global this machine reached by a wrong turn must not
        # become a finding.
        raise Fallback(str(exc)) from None
    finally:
        if enabled:
            gc.enable()


def unframe(f) -> bytearray:
    """The opcodes of a protocol 4/5 pickle without its FRAME headers, in one buffer."""
    head = f.read(2)
    if len(head) < 2 or head[0] != 0x80 or head[1] not in (4, 5):
        raise Fallback("not protocol 4 or 5")
    try:
        size = os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError):  # not a file (BytesIO): seeking costs no read there
        here = f.tell()
        size = f.seek(0, 2)
        f.seek(here)
    buf = bytearray(size)  # at most this long; trimmed at the end
    view = memoryview(buf)
    n = 0
    while True:
        hdr = f.read(9)
        if not hdr:
            break
        if hdr[0] != 0x95 or len(hdr) < 9:
            raise Fallback("opcodes outside a frame")  # large objects outside frames: not in DCP's index
        length = int.from_bytes(hdr[1:], "little")
        if n + length > size:
            raise EOFError("frame longer than the file")
        got = f.readinto(view[n : n + length])
        if got != length:
            raise EOFError("pickle data was truncated")
        n += length
    view.release()
    del buf[n:]
    return buf


class OpcodeMachine:
    def __init__(self, buf: bytearray):
        self.buf = buf
        self.memo: Dict[int, object] = {}
        self.next_memo = 0
        self.rev: Dict[tuple, int] = {}  # ('s', str) / ('g', module, name) -> first memo index
        self.chunk_runs: List[Tuple[int, list]] = []  # (first memo index, boxes): 8 memo entries a box
        self.chunk_run_starts: List[int] = []
        self.chunk_re = None
        self.chunk_key = None
        self.storage_re = None
        self.storage_key = None
        self.mi_keys = self.si_keys = None
        self.ends: Dict[object, int] = {}  # relative path (or its memo reference bytes) -> end
        self.box_cache: Dict[bytes, tuple] = {}
        self.write_item_key = self.write_item_re = None
        self.write_items = 0  # WriteItems stepped over by the expression
        self.path_runs: List[Tuple[List[int], List[bytes]]] = []  # (memo indices, spelled-out paths)
        self.path_run_starts: List[int] = []

    # -- memo ---------------------------------------------------------------------------------
    def _memoize(self, obj) -> None:
        idx = self.next_memo
        self.memo[idx] = obj
        self.next_memo = idx + 1
        if type(obj) is str:
            self.rev.setdefault(("s", obj), idx)

    def _get(self, idx: int):
        try:
            return self.memo[idx]
        except KeyError:
            pass
        i = bisect_right(self.chunk_run_starts, idx) - 1
        if i >= 0:
            base, boxes = self.chunk_runs[i]
            k, slot = divmod(idx - base, 8)
            if k < len(boxes) and slot in (2, 4, 5, 7):
                return boxes[k][0] if slot < 5 else boxes[k][1]
            if k < len(boxes) and slot in (3, 6):
                return (boxes[k][0] if slot == 3 else boxes[k][1],)
            if k < len(boxes):  # the chunk itself (0) or its state (1): referenced again, e.g. by a SavePlan
                state = {"offsets": boxes[k][0], "sizes": boxes[k][1]}
                if slot == 1:
                    return state
                rec = DcpRecord("ChunkStorageMetadata")
                rec.state = state
                return rec
        i = bisect_right(self.path_run_starts, idx) - 1
        if i >= 0:
            at, paths = self.path_runs[i]
            k = bisect_right(at, idx) - 1
            if k >= 0 and at[k] == idx:
                return _spelled(paths[k])
        raise Fallback(f"memo reference {idx} not kept")

    # -- the machine --------------------------------------------------------------------------
    def run(self) -> Index:
        """Run the opcodes up to STOP, each through its handler in ``dcp_scan_ops.OPS`` (which
        returns where the next opcode starts); the repeated units go many at a time (:meth:`_fetch`)."""
        buf, stack, marks, ops = self.buf, [], [], OPS
        pos, end = 0, len(buf)
        while True:
            if pos >= end:
                raise EOFError("pickle data was truncated")
            op = buf[pos]
            if op == 0x2E:  # STOP
                if len(stack) != 1 or marks:
                    raise Fallback("STOP with a bad stack")
                return self._finish(stack[0])
            pos = ops[op](self, buf, pos + 1, stack, marks)

    def _fetch(self, idx: int, at: int, after: int, stack) -> int:
        """The memo reference at ``at`` (its operand ends at ``after``): a DCP class whose units
        repeat starts a hot run where they match (many units at once: returns where the run ends);
        anything else is pushed."""
        obj = self._get(idx)
        if isinstance(obj, type) and issubclass(obj, (safe_pickle.FastStub, safe_pickle.Stub)):
            hot_run = _HOT_RUNS.get(obj._name)
            hot = hot_run(self, at, stack) if hot_run is not None else 0
            if hot:
                return hot
        stack.append(obj)
        return after

    def _new(self, cls, args):
        if not isinstance(cls, type) or type(args) is not tuple:
            raise Fallback("NEWOBJ")
        if issubclass(cls, safe_pickle.FastStub):
            if args:
                raise Fallback("NEWOBJ with arguments")
            return DcpRecord(cls._name.rsplit(".", 1)[1])
        if issubclass(cls, safe_pickle.Stub):
            return cls.__new__(cls, *args)
        raise Fallback("NEWOBJ of a non-stub")

    # -- learning the spellings of the repeated units -----------------------------------------------
    def _learn(self, rec: DcpRecord) -> None:
        st = rec.state
        if type(st) is not dict:
            return
        if rec.name == "MetadataIndex" and "offset" in st and self.mi_keys is None:
            self.mi_keys = list(st)
        elif rec.name == "_StorageInfo" and self.si_keys is None and self.mi_keys is not None:
            self.si_keys = list(st)

    def _key_refs(self, keys) -> Optional[List[bytes]]:
        out = []
        for k in keys:
            idx = self.rev.get(("s", k))
            if idx is None:
                return None
            out.append(_ref(idx))
        return out

    def _size_ref(self) -> Optional[bytes]:
        idx = self.rev.get(("g", "torch", "Size"))
        return None if idx is None else _ref(idx)

    def _chunk_run(self, pos: int, stack) -> int:
        """Match consecutive ChunkStorageMetadata units at ``pos``; push their boxes; return the end.

        Each unit is ``<class> () NEWOBJ {} ( 'offsets' Size(ints) 'sizes' Size(ints) SETITEMS BUILD``
        with every object memoized (8 memo entries). The run is matched by one regular expression;
        then it is cut at each unit's fixed head and each body (the two int tuples, the only part that
        varies) is looked up in a cache: the chunks of a model repeat the same few boxes."""
        buf = self.buf
        cls_ref = bytes(buf[pos : pos + (2 if buf[pos] == 0x68 else 5)])
        refs = self._key_refs(("offsets", "sizes"))
        size_ref = self._size_ref()
        if refs is None or size_ref is None:
            return 0
        key = (cls_ref, refs[0], refs[1], size_ref)
        if key != self.chunk_key:
            e = re.escape
            head = cls_ref + b")\x81\x94}\x94("

            def body(g):
                return (
                    e(refs[0])
                    + e(size_ref)
                    + g(_INTS)
                    + rb"\x85\x94R\x94"
                    + e(refs[1])
                    + e(size_ref)
                    + g(_INTS)
                    + rb"\x85\x94R\x94ub"
                )

            self.chunk_re = (
                head,
                re.compile(body(lambda x: b"(" + x + b")"), re.S),
                re.compile(b"(?:" + e(head) + body(lambda x: b"(?:" + x + b")") + b")++", re.S),
            )
            self.chunk_key = key
            self.box_cache = {}
        head, body_re, run_re = self.chunk_re
        m = run_re.match(buf, pos)
        if m is None:
            return 0
        bodies = bytes(buf[pos + len(head) : m.end()]).split(head)
        cache = self.box_cache
        boxes = list(map(cache.get, bodies))
        if None in boxes:
            if len(cache) > 200_000:
                cache.clear()
            for i, box in enumerate(boxes):
                if box is None:
                    body = bodies[i]
                    box = cache.get(body)
                    if box is None:
                        bm = body_re.fullmatch(body)
                        if bm is None:  # the head's bytes inside a body: cut wrong, so not this way
                            raise Fallback("chunk run")
                        box = cache[body] = (_ints(bm.group(1)), _ints(bm.group(2)))
                    boxes[i] = box
        base = self.next_memo
        self.chunk_runs.append((base, boxes))
        self.chunk_run_starts.append(base)
        self.next_memo = base + 8 * len(boxes)
        stack.extend(boxes)
        return m.end()

    def _storage_run(self, pos: int, stack) -> int:
        """Match consecutive storage entries of tensor chunks (MetadataIndex with an offset ->
        _StorageInfo) at ``pos``; fold them into the data files' extents (``stack`` gets nothing:
        the entries leave the index's ``storage_data``); return the end."""
        if self.mi_keys is None or self.si_keys is None:
            return 0
        buf = self.buf
        mi_ref = bytes(buf[pos : pos + (2 if buf[pos] == 0x68 else 5)])
        si_idx = self.rev.get(("g", "torch.distributed.checkpoint.filesystem", "_StorageInfo"))
        mi_refs, si_refs, size_ref = self._key_refs(self.mi_keys), self._key_refs(self.si_keys), self._size_ref()
        if si_idx is None or mi_refs is None or si_refs is None or size_ref is None:
            return 0
        key = (mi_ref, si_idx, tuple(mi_refs), tuple(si_refs), size_ref)
        if key != self.storage_key:
            self.storage_key = key
            self.storage_re = self._storage_regex(mi_ref, _ref(si_idx), mi_refs, si_refs, size_ref)
        if self.storage_re is None:
            return 0
        unit_re, run_re = self.storage_re
        m = run_re.match(buf, pos)
        if m is None:
            return 0
        found = unit_re.findall(buf, pos, m.end())
        fqns, built, rels, offs, lens = zip(*found)
        n = len(found)
        # MetadataIndex: NEWOBJ, state, its fqn when spelled out, its torch.Size when built here (3);
        # _StorageInfo: NEWOBJ, state, its relative path when spelled out: the memo entries of a unit.
        inline_fqns = [f for f in fqns if f]
        if not strings_exact(inline_fqns):
            raise Fallback("string length")
        memo_idx = self.next_memo + 4 * n + len(inline_fqns) + 3 * (n - built.count(b""))
        spelled = bytes(map(itemgetter(0), rels)).translate(_IS_STR)
        if 1 in spelled:
            if not strings_exact(list(compress(rels, spelled))):
                raise Fallback("string length")
            self._spelled_paths(self.next_memo, fqns, built, rels, spelled)
            memo_idx += spelled.count(1)
        # The values, decoded without a Python step per entry: int.from_bytes of the whole field is
        # the opcode byte (K, M, J), or the opcode and a length byte (LONG1), then the value.
        ends_b = list(map(add, _values(offs), _values(lens)))
        ends = self.ends
        get = ends.get
        for rel, e in zip(rels, ends_b):
            if e > get(rel, -1):
                ends[rel] = e
        self.next_memo = memo_idx
        return m.end()

    def _spelled_paths(self, base, fqns, built, rels, spelled) -> None:
        """Relative paths spelled out inside a run: where they are memoized, for a later reference
        (kept as they are; decoded only if one comes). C loops only: a checkpoint can spell the path
        out in every entry."""
        before = list(map(add, map(add, repeat(4), map(bool, fqns)), map(mul, repeat(3), map(bool, built))))
        upto = list(accumulate(map(add, before, spelled), initial=base))  # first memo index of each unit
        at = list(compress(map(add, upto, before), spelled))
        self.path_runs.append((at, list(compress(rels, spelled))))
        self.path_run_starts.append(at[0])

    def _write_item_run(self, pos: int, stack) -> int:
        """Match consecutive ``WriteItem`` units of ``all_local_plans`` (Megatron's torch_dist save
        keeps every rank's save plan in the index: one WriteItem a chunk) and step over them: the
        doctor uses nothing in them. What they may contain is fixed by the expression (references to
        objects already read, ints, names, ``torch.Size`` by its reference): no global, no call."""
        if self.mi_keys is None:
            return 0
        buf = self.buf
        wi_ref = bytes(buf[pos : pos + (2 if buf[pos] == 0x68 else 5)])
        g = self.rev.get
        classes = [
            g(("g", _DCP_MD[:-1], "MetadataIndex")),
            g(("g", _DCP_PLANNER[:-1], "TensorWriteData")),
            g(("g", _DCP_MD[:-1], "TensorProperties")),
            g(("g", _DCP_MD[:-1], "ChunkStorageMetadata")),
        ]
        keys = self._key_refs(
            ("index", "type", "bytes_io_data", "tensor_data", "chunk", "properties", "size", "offsets", "sizes")
        )
        mi_refs, size_ref = self._key_refs(self.mi_keys), self._size_ref()
        if None in classes or keys is None or mi_refs is None or size_ref is None:
            return 0
        key = (wi_ref, tuple(classes), tuple(keys), tuple(mi_refs), size_ref)
        if key != self.write_item_key:
            self.write_item_key = key
            self.write_item_re = self._write_item_regex(wi_ref, [_ref(c) for c in classes], keys, mi_refs, size_ref)
        if self.write_item_re is None:
            return 0
        unit_re, run_re = self.write_item_re
        m = run_re.match(buf, pos)
        if m is None:
            return 0
        found = unit_re.findall(buf, pos, m.end())
        groups = list(zip(*found))
        if not strings_exact([f for f in groups[0] if f]):
            raise Fallback("string length")
        n = len(found)
        # WriteItem, MetadataIndex, TensorWriteData: NEWOBJ and state each (6); the fqn spelled out (1);
        # a torch.Size built (3 each); a chunk built (8); TensorProperties built (NEWOBJ, state tuple: 2)
        built = [n - g.count(b"") for g in groups]
        self.next_memo += 6 * n + built[0] + 3 * built[1] + 8 * built[2] + 2 * built[3] + 3 * built[4]
        stack.extend(repeat(None, n))  # the plan's items: not used
        self.write_items += n
        return m.end()

    def _write_item_regex(self, wi_ref, classes, keys, mi_refs, size_ref):
        with_groups = self._write_item_unit(wi_ref, classes, keys, mi_refs, size_ref, lambda x: b"(" + x + b")")
        if with_groups is None:
            return None
        plain = self._write_item_unit(wi_ref, classes, keys, mi_refs, size_ref, lambda x: b"(?:" + x + b")")
        return re.compile(with_groups, re.S), re.compile(b"(?:" + plain + b")++", re.S)

    def _write_item_unit(self, wi_ref, classes, keys, mi_refs, size_ref, g):
        e = re.escape
        mi_cls, twd_cls, props_cls, chunk_cls = classes
        k_index, k_type, k_bytes, k_td, k_chunk, k_props, k_size, k_offsets, k_sizes = keys
        head = rb"\)\x81\x94\}\x94\("
        built_size = e(size_ref) + _INTS + rb"\x85\x94R\x94"
        # groups: fqn spelled out, MetadataIndex's Size built, chunk built, properties built, Size built
        mi_values = {
            "fqn": b"(?:" + _REF + b"|" + g(_STR) + b")",
            "index": b"(?:N|" + _INT + b")",
            "offset": b"(?:" + g(e(size_ref[:1])) + e(size_ref[1:]) + _INTS + rb"\x85\x94R\x94|" + _REF + b")",
        }
        if sorted(self.mi_keys) != sorted(mi_values):
            return None
        mi = e(mi_cls) + head + b"".join(e(r) + mi_values[k] for k, r in zip(self.mi_keys, mi_refs)) + b"ub"
        chunk = (
            b"(?:" + _REF + b"|" + g(e(chunk_cls)) + head + e(k_offsets) + built_size + e(k_sizes) + built_size + b"ub)"
        )
        props = b"(?:" + _REF + b"|" + g(e(props_cls)) + rb"\)\x81\x94\((?:" + _REF + rb"|N|\x88|\x89){5}t\x94b)"
        size = b"(?:" + _REF + b"|" + g(e(size_ref[:1])) + e(size_ref[1:]) + _INTS + rb"\x85\x94R\x94)"
        return (
            e(wi_ref)
            + head
            + e(k_index)
            + mi
            + e(k_type)
            + _REF
            + e(k_bytes)
            + b"N"
            + e(k_td)
            + e(twd_cls)
            + head
            + e(k_chunk)
            + chunk
            + e(k_props)
            + props
            + e(k_size)
            + size
            + b"ubub"
        )

    def _storage_regex(self, mi_ref, si_ref, mi_refs, si_refs, size_ref):
        if [k for k in self.mi_keys if k in ("fqn", "offset")] != ["fqn", "offset"] or [
            k for k in self.si_keys if k in ("relative_path", "offset", "length")
        ] != ["relative_path", "offset", "length"]:
            return None
        e = re.escape
        known = {"fqn", "index", "offset"}, {"relative_path", "offset", "length", "transform_descriptors"}
        if not set(self.mi_keys) <= known[0] or not set(self.si_keys) <= known[1]:
            return None

        def unit(g):  # g(x): x as a group (for findall) or not (for the run, whose groups cost time)
            # groups: fqn spelled out (else empty: a reference), torch.Size built (else empty), path, offset, length
            values = {
                "fqn": b"(?:" + _REF + b"|" + g(_STR) + b")",
                "index": b"(?:N|" + _INT + b")",
                "offset": b"(?:" + g(e(size_ref[:1])) + e(size_ref[1:]) + _INTS + rb"\x85\x94R\x94|" + _REF + b")",
            }
            si_values = {
                "relative_path": g(_REF + b"|" + _STR),
                "offset": g(_INT),
                "length": g(_INT),
                "transform_descriptors": b"N",
            }
            return b"".join(
                [e(mi_ref) + rb"\)\x81\x94\}\x94\("]
                + [e(r) + values[k] for k, r in zip(self.mi_keys, mi_refs)]
                + [b"ub" + e(si_ref) + rb"\)\x81\x94\}\x94\("]
                + [e(r) + si_values[k] for k, r in zip(self.si_keys, si_refs)]
                + [b"ub"]
            )

        return (
            re.compile(unit(lambda x: b"(" + x + b")"), re.S),
            re.compile(b"(?:" + unit(lambda x: b"(?:" + x + b")") + b")++", re.S),
        )

    # -- the result ---------------------------------------------------------------------------
    def _finish(self, top) -> Index:
        if type(top) is not DcpRecord or top.name != "Metadata" or type(top.state) is not dict:
            raise Fallback("not a Metadata")
        sdm_in = top.state.get("state_dict_metadata")
        if type(sdm_in) is not dict:
            raise Fallback("no state_dict_metadata")
        sdm = {}
        for fqn, meta in sdm_in.items():
            if type(meta) is DcpRecord and meta.name == "BytesStorageMetadata":  # no fields: no state
                sdm[fqn] = BytesMeta()
                continue
            if type(meta) is not DcpRecord or type(meta.state) is not dict:
                raise Fallback("state_dict_metadata entry")
            st = meta.state
            chunks = st.get("chunks")
            size = st.get("size")
            if meta.name != "TensorStorageMetadata" or type(chunks) is not list or type(size) is not tuple:
                raise Fallback("tensor entry")
            for i, c in enumerate(chunks):
                if type(c) is not tuple:
                    if type(c) is not DcpRecord or type(c.state) is not dict:
                        raise Fallback("chunk entry")
                    chunks[i] = (c.state["offsets"], c.state["sizes"])
            sdm[fqn] = TensorMeta(size, chunks)
        ends: Dict[str, int] = {}
        for rel, e in self.ends.items():  # keyed by the path's field: spelled out, or a memo reference
            if rel[0] == 0x8C:
                rel = _spelled(rel)
            else:
                rel = self._get(rel[1] if rel[0] == 0x68 else struct.unpack_from("<I", rel, 1)[0])
                if type(rel) is not str:
                    raise Fallback("relative_path")
            if e > ends.get(rel, -1):
                ends[rel] = e
        objects: Dict[str, List[Tuple[int, int, str]]] = {}
        storage = top.state.get("storage_data") or {}
        if type(storage) is not dict:
            raise Fallback("storage_data")
        for key, info in storage.items():  # the entries the hot runs did not take
            if type(key) is not DcpRecord or type(info) is not DcpRecord:
                raise Fallback("storage entry")
            ks, st = key.state, info.state
            rel, offset, length = st.get("relative_path"), st.get("offset", 0), st.get("length", 0)
            if type(rel) is not str or type(offset) is not int or type(length) is not int:
                raise Fallback("storage entry fields")
            if offset + length > ends.get(rel, -1):
                ends[rel] = offset + length
            if ks.get("offset") is None and not st.get("transform_descriptors"):
                objects.setdefault(rel, []).append((offset, length, str(ks.get("fqn", "?"))))
        return Index(sdm, ends, objects)


_HOT_RUNS = {  # class (as safe_pickle names its stand-in) -> the matcher of its repeated units
    _DCP_MD + "ChunkStorageMetadata": OpcodeMachine._chunk_run,
    _DCP_MD + "MetadataIndex": OpcodeMachine._storage_run,
    _DCP_PLANNER + "WriteItem": OpcodeMachine._write_item_run,
}
