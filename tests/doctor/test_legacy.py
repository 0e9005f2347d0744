"""Legacy mp_rank_* layouts: class, reason, expected names, loader, and every mismatch with the run.

Checkpoints: torch.save of the state dict megatron.training writes for ckpt_format 'torch', in the
directories get_checkpoint_name names (see ckpt_makers for what is real and what is not).
"""

import os
import shutil

import pytest

from ckpt_makers import checkpoint_name, save_legacy
from mcore_ckpt_fixes.doctor import diagnose, expected_dirnames, inspect, shard_dir
from mcore_ckpt_fixes.doctor.legacy import shard_dirname

# (tp, pp, ep) -> names Megatron writes: pp index only when pp > 1, ep index only when ep > 1.
NAMES = {
    (2, 1, 1): ["mp_rank_00", "mp_rank_01"],
    (2, 2, 1): ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"],
    (2, 1, 2): ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"],
    (1, 2, 2): ["mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"],
}


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    base = tmp_path_factory.mktemp("legacy")
    out = {sizes: save_legacy(str(base / "tp{}pp{}ep{}".format(*sizes)), *sizes) for sizes in NAMES}
    out["noargs"] = save_legacy(str(base / "noargs"), 2, 1, 2, with_args=False)
    return out


def codes(report):
    return [p["code"] for p in report.problems]


@pytest.mark.parametrize("sizes", list(NAMES), ids=lambda s: "tp{}pp{}ep{}".format(*s))
def test_names_follow_megatron(sizes):
    assert sorted(expected_dirnames(*sizes)) == NAMES[sizes]


def test_names_equal_get_checkpoint_name():
    ckpt = pytest.importorskip(
        "megatron.training.checkpointing",
        reason="megatron.training not importable here (0.16 wheels do not ship it; 0.17/0.18 need PyYAML)",
    )
    for tp, pp, ep in [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (4, 3, 5)]:
        for t in range(tp):
            for p in range(pp):
                for e in range(ep):
                    real = ckpt.get_checkpoint_name(
                        "/r",
                        7,
                        pipeline_parallel=pp > 1,
                        tensor_rank=t,
                        pipeline_rank=p,
                        expert_parallel=ep > 1,
                        expert_rank=e,
                    )
                    assert os.path.dirname(real) == shard_dir("/r", 7, t, p, e, pp=pp, ep=ep)


@pytest.mark.parametrize(
    "sizes, layout, loader, second",
    [
        ((2, 1, 1), "1D", "non-ep", None),
        ((2, 2, 1), "2D", "non-ep", "pp"),
        ((2, 1, 2), "2D", "ep-aware", "ep"),
        ((1, 2, 2), "3D", "ep-aware", None),
    ],
    ids=["1D", "2D-pp", "2D-ep", "3D"],
)
def test_classified_from_saved_args(legacy, sizes, layout, loader, second):
    r = inspect(os.path.dirname(legacy[sizes]))
    assert (r["format"], r["layout"], r["loader"], r["second_index"]) == ("torch", layout, loader, second)
    assert r["expected"] == r["on_disk"] == NAMES[sizes] and r["missing"] == r["extra"] == []
    assert (r["saved_args"]["tp"], r["saved_args"]["pp"], r["saved_args"]["ep"]) == sizes
    assert r["iteration"] == 100 and r.ok, r.problems
    if second:
        assert "saved args: pipeline_model_parallel_size" in r["layout_reason"]
    assert r["sizes"]["tp"]["source"] == f"saved args in {NAMES[sizes][0]}/model_optim_rng.pt"


def test_same_names_other_meaning(legacy):
    """Saved with EP=2, pp=1; read with pp=2, ep=1: identical names, every rank would load the wrong shard."""
    r = inspect(os.path.dirname(legacy[(2, 1, 2)]), tp=2, pp=2, ep=1)
    assert r["missing"] == r["extra"] == []
    assert codes(r) == ["index-meaning-mismatch", "size-mismatch"]
    assert "on disk the second index is the ep rank and this run reads it as the pp rank" in r.problems[0]["message"]


def test_ambiguous_without_args_then_told_by_flags(legacy):
    root = os.path.dirname(legacy["noargs"])
    r = inspect(root)
    assert r["layout"] == "ambiguous" and r["loader"] == "ep-aware" and codes(r) == ["ambiguous-layout"]
    r = inspect(root, ep=2)
    assert (r["layout"], r["second_index"], r["loader"]) == ("2D", "ep", "ep-aware") and r.ok, r.problems
    r = inspect(root, pp=2)
    assert (r["layout"], r["second_index"], r["loader"]) == ("2D", "pp", "non-ep") and r.ok, r.problems


def test_missing_and_extra_shard_dirs(legacy, tmp_path):
    root = str(tmp_path / "ck")
    shutil.copytree(os.path.dirname(legacy[(2, 1, 2)]), root)
    it = os.path.join(root, "iter_0000100")
    shutil.rmtree(os.path.join(it, "mp_rank_01_001"))
    shutil.copytree(os.path.join(it, "mp_rank_00_000"), os.path.join(it, "mp_rank_02_000"))
    r = inspect(root)
    assert r["missing"] == ["mp_rank_01_001"] and r["extra"] == ["mp_rank_02_000"]
    assert codes(r) == ["missing-shard-dirs", "extra-shard-dirs"]
    assert "No such file or directory: '.../mp_rank_01_001/model_optim_rng.pt'" in r.problems[0]["message"]


def test_run_sizes_differ(legacy):
    r = inspect(os.path.dirname(legacy[(2, 1, 1)]), tp=4)
    assert r["missing"] == ["mp_rank_02", "mp_rank_03"] and r["extra"] == []
    assert codes(r) == ["missing-shard-dirs", "size-mismatch"]
    r = inspect(os.path.dirname(legacy[(2, 1, 1)]), ep=2)  # the run looks for mp_rank_TT_EEE
    assert r["loader"] == "ep-aware" and sorted(r["extra"]) == NAMES[(2, 1, 1)] and len(r["missing"]) == 4


def test_missing_model_file(legacy, tmp_path):
    root = str(tmp_path / "ck")
    shutil.copytree(os.path.dirname(legacy[(2, 2, 1)]), root)
    os.remove(os.path.join(root, "iter_0000100", "mp_rank_01_001", "model_optim_rng.pt"))
    assert codes(inspect(root)) == ["missing-files"]


def test_reads_the_pickle_record_only(tmp_path):
    """A 4 MB weight: the doctor reads the args record, not the tensor data."""
    it = save_legacy(str(tmp_path / "big"), 1, 1, 1, weight_numel=1 << 20)
    r = inspect(it)
    size = os.path.getsize(os.path.join(it, "mp_rank_00", "model_optim_rng.pt"))
    assert r.ok and r["saved_args"]["tp"] == 1 and 0 < r.bytes_read < size / 100, (r.bytes_read, size)


def test_arbitrary_code_is_never_run(tmp_path):
    import pickle
    import zipfile

    marker = tmp_path / "pwned"
    it = save_legacy(str(tmp_path / "evil"), 2, 1, 1)
    path = os.path.join(it, "mp_rank_00", "model_optim_rng.pt")

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with zipfile.ZipFile(path) as zf:
        entries = {n: zf.read(n) for n in zf.namelist()}
    pkl = next(n for n in entries if n.endswith("data.pkl"))
    entries[pkl] = pickle.dumps({"args": Evil()}, protocol=2)
    with zipfile.ZipFile(path, "w") as zf:
        for n, data in entries.items():
            zf.writestr(n, data)
    r = inspect(it)
    assert not marker.exists()
    assert r["saved_args"] is None and r["layout"] == "1D"
    assert any("refusing to load posix.system (not on the doctor's allow-list)" in n for n in r.notes), r.notes
    # Megatron's torch.load(weights_only=False) would run it: a problem naming the file and the callable.
    assert [(p["code"], p["file"], p["callable"]) for p in r.problems] == [
        ("unsafe-pickle", "mp_rank_00/model_optim_rng.pt", "posix.system")
    ]


def test_api_shard_dir_and_diagnose(legacy, tmp_path):
    assert shard_dir("/ck", 1000, 1, ep_rank=1, pp=1, ep=2) == "/ck/iter_0001000/mp_rank_01_001"
    assert shard_dir("/ck", None, 0, 1, 0, pp=2) == "/ck/release/mp_rank_00_001"
    assert shard_dirname(3, 2, 1, pp_size=4, ep_size=2) == "mp_rank_03_002_001"
    with pytest.raises(ValueError, match="pp_rank=2 is outside 0..1"):
        shard_dir("/ck", 1, 0, 2, pp=2)
    for tp, pp, ep in NAMES:  # the API names what the real save wrote
        for t in range(tp):
            assert os.path.dirname(checkpoint_name("/ck", 5, t, pp - 1, ep - 1, pp, ep)) == shard_dir(
                "/ck", 5, t, pp - 1, ep - 1, pp=pp, ep=ep
            )
    bad = diagnose(str(tmp_path / "nothing"))
    assert codes(bad) == ["unreadable"] and "no such directory" in bad.problems[0]["message"]
