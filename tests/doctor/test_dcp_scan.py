"""The stream reader of DCP's ``.metadata`` (dcp_scan) against the allow-list unpickler: the same
index (shapes, chunk boxes, data-file extents, byte objects) for what this release's save writes and
for the spellings pickle can give the same data (shared objects, every tuple length, big ints,
paths spelled out per entry), and the fallback whenever it cannot tell."""

import io
import os
import pickle

import pytest

from doctor_fixtures import iter_dir, saved  # noqa: F401  (fixtures)
from mcore_ckpt_fixes.doctor import dcp, dcp_scan, inspect, safe_pickle


def _norm(ix):
    sdm = {}
    for k, m in ix.state_dict_metadata.items():
        sdm[k] = (
            None if isinstance(m, dcp_scan.BytesMeta) else (tuple(m.size), [(tuple(o), tuple(s)) for o, s in m.chunks])
        )
    return sdm, dict(ix.ends), {k: sorted(v) for k, v in ix.objects.items()}


def _both(data: bytes):
    machine = dcp_scan.OpcodeMachine(dcp_scan.unframe(io.BytesIO(data)))
    fast = machine.run()
    slow = dcp.index_from_unpickled(safe_pickle.load(io.BytesIO(data)))
    assert _norm(fast) == _norm(slow)
    return machine, fast


def _metadata(
    n_tensors=3,
    grid=(2, 3),
    *,
    shared_size=False,
    spelled_paths=False,
    shared_fqn=False,
    big=False,
    dims=2,
    byte_objects=True,
    protocol=4,
    local_plans=False,
    name="linear_fc1",
):
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm, storage, ends = {}, {}, {}
    base = 1 << 33 if big else 0
    path = {}
    for t in range(n_tensors):
        fqn = f"decoder.layers.{t}.mlp.{name}.weight"
        chunks = []
        cells = [(i, j) for i in range(grid[0]) for j in range(grid[1])]
        for i, j in cells:
            off = torch.Size([i * 4, j * 8] + [0] * (dims - 2))[:dims] if dims else torch.Size([])
            size = torch.Size([4, 8] + [2] * (dims - 2))[:dims] if dims else torch.Size([])
            chunks.append(ChunkStorageMetadata(offsets=off, sizes=size))
            rel = f"__{(i * grid[1] + j) % 3}_0.distcp"
            if not spelled_paths:
                rel = path.setdefault(rel, rel)
            else:
                rel = "".join(list(rel))  # a new str object each time: spelled out in every entry
            start = ends.get(rel, base)
            key = MetadataIndex(fqn if shared_fqn else "".join(list(fqn)), off if shared_size else torch.Size(off))
            storage[key] = _StorageInfo(relative_path=rel, offset=start, length=128 + t)
            ends[rel] = start + 128 + t
            if not dims:
                break
        shape = [grid[0] * 4, grid[1] * 8] + [2] * (dims - 2) if dims else []
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape[:dims]), chunks)
    if byte_objects:
        for name in ("rng_state/shard_0.0_1.1", "common_state/shard_0_1"):
            sdm[name] = BytesStorageMetadata()
            rel = path.setdefault("__0_0.distcp", "__0_0.distcp")
            storage[MetadataIndex(name)] = _StorageInfo(relative_path=rel, offset=ends.get(rel, base), length=77)
            ends[rel] = ends.get(rel, base) + 77
    md = Metadata(state_dict_metadata=sdm, storage_data=storage)
    if local_plans:  # as Megatron's torch_dist save keeps them (save_state_dict_async_plan)
        md.all_local_plans = _plans(sdm)
    return pickle.dumps(md, protocol=protocol)


def _plans(sdm, ranks=2):
    """Every rank's SavePlan: rank 0's items share the index's objects (create_global_plan took them
    from its plan), the other ranks' came through gather_object (copies: everything spelled out)."""

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    plans = []
    for r in range(ranks):
        items = []
        for fqn, meta in sdm.items():
            for c in getattr(meta, "chunks", [])[r::ranks]:
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, c.offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk=c, properties=meta.properties, size=meta.size),
                    )
                )
        plan = SavePlan(items)
        plans.append(plan if r == 0 else pickle.loads(pickle.dumps(plan)))
    return plans


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"shared_size": True},
        {"spelled_paths": True},
        {"shared_fqn": True},
        {"big": True},
        {"dims": 1},
        {"dims": 3},
        {"dims": 4},
        {"dims": 5},
        {"dims": 0},
        {"byte_objects": False},
        {"protocol": 5},
        {"n_tensors": 40, "grid": (8, 8), "spelled_paths": True, "shared_fqn": True},
        {"n_tensors": 40, "grid": (8, 8), "shared_size": True, "big": True},
        {"local_plans": True},
        {"local_plans": True, "dims": 4},
        {"local_plans": True, "n_tensors": 30, "grid": (6, 6)},
    ],
)
def test_same_index_as_the_unpickler(variant):
    machine, _ = _both(_metadata(**variant))
    if variant.get("dims", 2):  # the repeated units went the fast way
        assert machine.ends  # storage entries of tensor chunks
        if not variant.get("shared_size"):
            assert machine.chunk_runs


def test_hot_runs_on_a_large_index():
    machine, ix = _both(_metadata(n_tensors=50, grid=(10, 20), spelled_paths=True, local_plans=True))
    assert sum(len(b) for _, b in machine.chunk_runs) >= 50 * 200 - 60
    assert machine.write_items >= 2 * 50 * 200 // 2 - 100  # both ranks' plans: rank 0's and the copied one
    assert sum(len(m.chunks) for m in ix.state_dict_metadata.values() if isinstance(m, dcp_scan.TensorMeta)) == 10000


def test_names_holding_the_memoize_byte(tmp_path):
    """U+0514 is D4 94 in UTF-8: 0x94 (MEMOIZE) inside a name. Either way, the same index, and
    strings_exact refuses a cut that disagrees with the length byte."""
    data = _metadata(name="\u0514", local_plans=True, spelled_paths=True)
    path = tmp_path / ".metadata"
    path.write_bytes(data)

    class R:
        bytes_read = 0

    r = R()
    assert _norm(dcp.read_metadata(str(path), r)) == _norm(dcp.index_from_unpickled(safe_pickle.load(io.BytesIO(data))))
    assert r.bytes_read >= len(data)
    assert dcp_scan.strings_exact([b"\x8c\x02ab\x94"]) and not dcp_scan.strings_exact([b"\x8c\x05ab\x94"])
    assert not dcp_scan.strings_exact([b"\x8c\x01ab\x94"])  # opcodes swallowed behind a string


def test_protocol_2_falls_back():
    with pytest.raises(dcp_scan.Fallback):
        dcp_scan.OpcodeMachine(dcp_scan.unframe(io.BytesIO(_metadata(protocol=2)))).run()


def test_cut_file_is_not_an_index():
    data = _metadata()
    with pytest.raises((EOFError, dcp_scan.Fallback, ValueError, IndexError)):
        dcp_scan.OpcodeMachine(dcp_scan.unframe(io.BytesIO(data[: len(data) // 2]))).run()


def test_saved_checkpoints_read_the_fast_way(saved):
    """What this release's dist_checkpointing and torch DCP write: no fallback, the same index."""
    for name in ("torch_dist", "fsdp", "fsdp_collide"):
        path = os.path.join(iter_dir(saved[name]), ".metadata")
        with open(path, "rb") as f:
            data = f.read()
        _both(data)
        with open(path, "rb") as f:
            assert isinstance(dcp_scan.read(f), dcp_scan.Index)


def test_fallback_gives_the_same_report(saved, monkeypatch):
    fast = {name: inspect(saved[name]).to_dict() for name in ("torch_dist", "fsdp", "fsdp_collide")}

    def refuse(f):
        raise dcp_scan.Fallback("test")

    monkeypatch.setattr(dcp_scan, "read", refuse)
    slow = {name: inspect(saved[name]).to_dict() for name in ("torch_dist", "fsdp", "fsdp_collide")}
    assert fast == slow
