"""Distributed checkpoints saved by this release (torch_dist) and by torch DCP (fsdp_dtensor keys),
and damaged copies of them: chunk coverage, expert keys, RNG and common-state layout, readable_by."""

import os
import pickle

import pytest

from doctor_fixtures import copy_of, iter_dir, saved  # noqa: F401  (fixtures)
from mcore_ckpt_fixes.doctor import Unreadable, inspect


def codes(r):
    return [p["code"] for p in r.problems]


def _edit_metadata(ckdir, edit):
    """Rewrite .metadata with the real DCP classes (this is the test's own trusted file)."""
    path = os.path.join(ckdir, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    edit(md)
    with open(path, "wb") as f:
        pickle.dump(md, f)


def test_torch_dist_clean(saved, mcore_version):
    # ep=1: a run with other sizes than the saved EP=2 (see test_sizes_from_the_saved_args)
    r = inspect(saved["torch_dist"], ep=1)
    assert r.ok, r.problems
    assert (r["format"], r["iteration"], r["tensors"], r["chunks"]) == ("torch_dist", 10, 11, 13)
    # layers.1's grouped weight (expert axis 0, 4 experts) is whole: counted, no finding
    assert r["experts"] == "8 expert keys in 1 expert blocks, 4 experts each; 1 single grouped expert tensor"
    assert r["rng_layout"].startswith("2-D (pp, tp)")
    files = os.listdir(iter_dir(saved["torch_dist"]))
    # Where this release keeps the common state, checked against what it wrote.
    if mcore_version.release[:2] >= (0, 19):
        assert "common.pt" not in files and r["common_state"].startswith("embedded")
        assert r["readable_by"] == ["0.19"]
    else:
        assert "common.pt" in files and r["common_state"].startswith("common.pt")
        assert r["readable_by"] == ["0.16", "0.17", "0.18", "0.19"]
    assert r["coverage_problems"] == [] and r["expert_problems"] == []


def test_rng_2d_under_ep(saved):
    r = inspect(saved["torch_dist"], ep=2)
    assert codes(r) == ["rng-2d-under-ep"]


def test_truncated_metadata_is_unreadable(saved, copy_of):
    root = copy_of(saved["torch_dist"])
    path = os.path.join(iter_dir(root), ".metadata")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(Unreadable, match=r"\.metadata \(\d+ bytes\): truncated or corrupt"):
        inspect(root)


def test_missing_metadata_json(saved, copy_of):
    root = copy_of(saved["torch_dist"])
    os.remove(os.path.join(iter_dir(root), "metadata.json"))
    r = inspect(root, ep=1)  # a run at EP=1: only the damage is found
    assert r["format"] == "torch_dist" and codes(r) == ["missing-metadata-json"] and r["readable_by"] == []


def test_incomplete_save(saved, copy_of):
    root = copy_of(saved["fsdp"])
    os.remove(os.path.join(iter_dir(root), ".metadata"))
    r = inspect(root)
    assert codes(r) == ["incomplete-save"] and r["readable_by"] == []


def test_missing_data_file(saved, copy_of):
    root = copy_of(saved["torch_dist"])
    os.remove(os.path.join(iter_dir(root), "__1_0.distcp"))
    r = inspect(root, ep=1)  # a run at EP=1: only the damage is found
    assert codes(r) == ["data-files"] and "__1_0.distcp is named by .metadata but missing" in r.problems[0]["message"]


def test_overlapping_and_missing_chunks(saved, copy_of):
    root = copy_of(saved["torch_dist"])
    key = "decoder.layers.0.self_attention.linear_qkv.weight"  # (8, 4): rows 0:4 from rank 0, 4:8 from rank 1

    def edit(md):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        chunks = md.state_dict_metadata[key].chunks
        assert sorted(tuple(c.offsets) for c in chunks) == [(0, 0), (4, 0)]
        second = next(c for c in chunks if c.offsets[0] == 4)
        chunks[chunks.index(second)] = ChunkStorageMetadata(offsets=type(second.offsets)([3, 0]), sizes=second.sizes)
        grouped = md.state_dict_metadata["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"]
        grouped.chunks = [c for c in grouped.chunks if c.offsets[0] == 0]

    _edit_metadata(iter_dir(root), edit)
    r = inspect(root, ep=1)  # a run at EP=1: only the damage is found
    assert codes(r) == ["chunk-coverage"] * 3, r.problems
    msgs = [p["message"] for p in r["coverage_problems"]]
    assert msgs == [
        f"{key} (shape [8, 4], 2 chunks): overlap: region [3:4, 0:4] is written by more than one chunk",
        f"{key} (shape [8, 4], 2 chunks): gap: region [7:8, 0:4] is in no chunk",
        "decoder.layers.1.mlp.experts.experts.linear_fc1.weight (shape [4, 4, 4], 1 chunks): gap: "
        "region [2:4, 0:4, 0:4] is in no chunk",
    ]
    assert r["readable_by"] == []


def test_duplicated_expert_key(saved, copy_of):
    root = copy_of(saved["torch_dist"])
    prefix = "decoder.layers.0.mlp.experts."

    def edit(md):  # expert 3's fc1 also stored under the grouped spelling
        md.state_dict_metadata[prefix + "linear_fc1.weight3"] = md.state_dict_metadata[
            prefix + "local_experts.3.linear_fc1.weight"
        ]

    _edit_metadata(iter_dir(root), edit)
    r = inspect(root, ep=1)  # a run at EP=1: only the damage is found
    assert codes(r) == ["expert-duplicate"]
    assert r["expert_problems"][0]["message"] == (
        "decoder.layers.0.mlp.experts: expert 3 of linear_fc1.weight is stored 2 times "
        "(linear_fc1.weight{i}, local_experts.{i}.linear_fc1.weight): a load reads one of them"
    )


def test_fsdp_dtensor_clean_and_colliding_bias_keys(saved):
    r = inspect(saved["fsdp"])
    assert r.ok, r.problems
    assert r["format"] == "fsdp_dtensor" and r["readable_by"] == ["0.16", "0.17", "0.18", "0.19"]
    assert r["experts"] == "8 expert keys in 1 expert blocks, 4 experts each" and r["rng_layout"].startswith("2-D")
    # Real DCP kept one writer of each colliding key: the other EP rank's biases are gone.
    r = inspect(saved["fsdp_collide"])
    assert codes(r) == ["expert-key-collision"]
    assert r["expert_problems"][0]["message"].startswith(
        "model.decoder.layers.0.mlp.experts: linear_fc1.bias has experts {0-1}, its sibling parameters {0-3}: "
        "EP ranks wrote it under their local indices {0-1}, so 2 ranks wrote the same keys"
    )


def test_reads_metadata_only(saved):
    """The index, metadata.json, the byte objects a load unpickles and common.pt's pickle record: never
    a tensor payload."""
    ck = iter_dir(saved["torch_dist"])
    r = inspect(saved["torch_dist"])
    md = os.path.getsize(os.path.join(ck, ".metadata")) + os.path.getsize(os.path.join(ck, "metadata.json"))
    with open(os.path.join(ck, ".metadata"), "rb") as f:
        index = pickle.load(f)  # the test's own trusted file
    objects = sum(info.length for key, info in index.storage_data.items() if key.offset is None)
    assert objects > 0  # the RNG state (and from 0.19 the common state) are byte objects
    common = os.path.join(ck, "common.pt")
    if os.path.exists(common):
        assert 0 < r.bytes_read - md - objects < os.path.getsize(common), r.bytes_read
    else:
        assert r.bytes_read == md + objects


def test_sizes_from_the_saved_args(saved, mcore_version):
    """Saved with EP=2 and the old 2-D RNG layout: flagged without --ep, the sizes and their source
    said (common.pt up to 0.18, the embedded common state from 0.19); a flag overrides."""
    r = inspect(saved["torch_dist"])
    where = "the embedded common state" if mcore_version.release[:2] >= (0, 19) else "common.pt"
    assert codes(r) == ["rng-2d-under-ep"] and "this run uses ep=2" in r.problems[0]["message"]
    assert r["sizes"]["ep"] == {"used": 2, "source": f"saved args in {where}", "saved": 2}
    assert r["sizes"]["tp"]["used"] == 1 and r["sizes"]["pp"] == {"used": None, "source": "unknown", "saved": None}
    assert f"sizes:      tp=1 ep=2 (saved args in {where})" in r.render()
    r = inspect(saved["torch_dist"], ep=1)
    assert r.ok and r["sizes"]["ep"] == {"used": 1, "source": "given", "saved": 2}
    assert f"sizes:      tp=1 (saved args in {where})  ep=1 (given)" in r.render()


def test_sizes_unknown_without_saved_args(saved):
    r = inspect(saved["fsdp"])
    assert all(v["source"] == "unknown" for v in r["sizes"].values())
    assert "sizes:      none readable from the checkpoint's saved args (give --tp/--pp/--ep)" in r.render()
