"""Resume on another layout (mcore_ckpt_fixes/resume/layouts.py) on this line: a job saves on one
layout and a job on another loads it; what it loaded, saved again at once in model space, must be
what the saving job held, bit for bit, as full tensors (every parameter, the fp32 main parameters,
the Adam moments, the iteration and the scheduler), or the load is refused as the release refuses
it. With the fixes, never worse than the release: exact where the release is exact, the release's
own refusal where it refuses. docs/resume.md has the table.

Each change costs two worlds per mode (save, then load on the other layout) of 1 to 4 ranks: every
change on the newest line, a subset on the older ones (CI's time).
"""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import needs_megatron_training, on_this_line

from mcore_ckpt_fixes.resume import check, layouts

# The release's own outcome per change, as measured (0.17.1, 0.18.2, 0.19.2): "exact", or the last
# line of the error its load stops with.
REFUSED_TP_PP = (
    "RuntimeError: (TP, PP) mismatch after resume ((1, 1) vs (2, 1) from checkpoint): not supported for "
    "DistributedOptimizer with sharding type dp_reshardable. Please use `--ckpt-fully-parallel-save` flag "
    "during checkpoint saving."
)
# An EP change, with the optimizer fully_reshardable: the two jobs' ChainedOptimizers hold another
# number of optimizers, and the release's load_state_dict stops on the count; with the fixes
# (ep-change-optimizer-chain) exact.
RELEASE = {
    "ep2-to-ep1": "KeyError: 'optimizer'",
    "ep1-to-ep2": "RuntimeError: Expected 2 entries in state dict, but got 4.",
    "tp2-to-tp1-dp-reshardable": REFUSED_TP_PP,
}
# Changes the release refuses and the fixes resume exactly.
FIXED = {"ep2-to-ep1", "ep1-to-ep2"}
# On 0.17 as well (the oldest line with megatron.training in the wheel; 0.18 gives the same outcomes,
# docs/resume.md): one change of each kind.
OLDER_LINES = {name: ((0, 17),) for name in ("tp2-to-tp1", "pp1-to-pp2", "dp4-to-dp2", "ep2-to-ep1")}


CHANGES = [c for c in layouts.CHANGES if on_this_line(c.name, OLDER_LINES)]


@pytest.mark.parametrize("change", CHANGES, ids=[c.name for c in CHANGES])
def test_resume_on_another_layout_loads_what_was_saved_or_is_refused_as_the_release_refuses(change):
    needs_megatron_training()
    check.prepare()
    out = layouts.run_change(change)
    for mode in ("off", "on"):
        expected = "exact" if mode == "on" and change.name in FIXED else RELEASE.get(change.name, "exact")
        got = out[mode]
        assert got["verdict"] != "error", (mode, got["error"], got["detail"][-3000:])
        if expected == "exact":
            assert got["verdict"] == "exact", (mode, got)
            assert got["iteration"] == [check.RESUME_AT] and got["n_compared"] >= 20, (mode, got)
        else:
            assert got["verdict"] == "refused", (mode, got)
            assert layouts.release_line(got) == expected, (mode, got["error"])
    assert out["as_release"], out


@pytest.mark.one_line
def test_the_comparison_sees_one_changed_byte(tmp_path):
    """The full-tensor comparison is not vacuous: a copy of a model-space save compares exact, and the
    same copy with one byte of one tensor's stored data changed differs in that tensor alone."""
    needs_megatron_training()
    import io

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from mcore_ckpt_fixes.testing.gpt_job import reference

    check.prepare()
    change = layouts.by_name("tp2-to-tp1")
    saved = str(tmp_path / "saved")
    _, error, detail = check.run_phase(change.saved, "reference", saved, check.MODES["on"], "cpu", 240.0)
    assert error is None, detail
    copy = str(tmp_path / "copy")
    shutil.copytree(reference(saved), copy)
    assert layouts.compare(reference(saved), copy)["differ"] == []

    iter_dir = os.path.join(copy, f"iter_{check.RESUME_AT:07d}")
    metadata = dcp.FileSystemReader(iter_dir).read_metadata()
    key = next(
        k
        for k, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata) and k.startswith("optimizer.state.exp_avg_sq.") and m.size.numel() > 64
    )
    index, where = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == key)
    # DCP stores each chunk as a torch.save blob, the tensor's bytes uncompressed inside it.
    with open(os.path.join(iter_dir, where.relative_path), "r+b") as f:
        f.seek(where.offset)
        blob = f.read(where.length)
        raw = torch.load(io.BytesIO(blob), weights_only=True).contiguous().view(torch.uint8).numpy().tobytes()
        at = blob.find(raw)
        assert at >= 0, index
        f.seek(where.offset + at)
        f.write(bytes([raw[0] ^ 0x40]))
    assert layouts.compare(reference(saved), copy)["differ"] == [key], index
