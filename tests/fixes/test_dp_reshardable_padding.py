"""dp-reshardable-padding: both halves on every release line, in one warm world per half.

World 2 (DP=2, gloo on CPU), a one-layer GPT whose word embedding is marked as a tied embedding on a
pipeline stage, Megatron's DDP and distributed optimizer on the FusedAdam path (the CPU stand-in of
mcore_ckpt_fixes/testing/_fused_adam.py), saved ``dp_reshardable`` and loaded with
``dist_checkpointing``. See mcore_ckpt_fixes/fixes/dp_reshardable_padding/checks/core.py.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.dp_reshardable_padding import FIX
from mcore_ckpt_fixes.testing import for_fix

CORE = "mcore_ckpt_fixes.fixes.dp_reshardable_padding.checks.core"
MODULE = "megatron.core.optimizer.distrib_optimizer"
SCENARIOS = {s.name: s for s in for_fix(FIX.id)}
CASES = ("release_layout", "all_padding_shard", "rank_without_parameters", "past_unpadded_end")
KINDS = ("main", "exp_avg", "exp_avg_sq")
BUCKETS = {  # (unpadded, padded) per bucket: the geometry each case is about
    "release_layout": [(22912, 22912), (2560, 2560)],
    "all_padding_shard": [(54720, 65536), (4096, 65536)],  # rank 1's half of bucket 1: [32768, 65536)
    "rank_without_parameters": [(22976, 65536), (2560, 65536)],  # rank 1: [32768, 65536) of each
    "past_unpadded_end": [(22976, 23040), (2560, 2560)],  # rank 1's shard of bucket 0 ends at 23040
}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:cases", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def _results(worlds, patched, case):
    results = [r[case] for r in worlds[patched]]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "applied" if patched else "disabled"}, (rank, r["fix_state"])
        assert [tuple(b) for b in r["buckets"]] == BUCKETS[case], (rank, case, r["buckets"])
    return results


@pytest.mark.parametrize("case", ("all_padding_shard", "rank_without_parameters"))
def test_unpatched_refuses_a_rank_whose_shard_is_all_padding(worlds, case, mcore_version):
    """Rank 1 stops building the request (a bucket gives it nothing but padding; in
    ``rank_without_parameters`` every bucket does); rank 0 would wait for it in the save's
    collectives: the check shares rank 1's error before they start."""
    results = _results(worlds, False, case)
    for rank, r in enumerate(results):
        assert (r["phase"], r["error"]) == ("request", "AssertionError: empty bucket encountered"), (rank, r)
        assert r["rank_errors"] == [None, "AssertionError: empty bucket encountered"], (rank, r["rank_errors"])
    assert SCENARIOS["all_padding_shard"].bug_for(mcore_version).seen_in(results)


def test_unpatched_save_past_the_unpadded_end_is_rejected_and_leaves_no_checkpoint(worlds, mcore_version):
    """torch DCP rejects rank 1's padding piece that runs past the bucket's tensor, on rank 0 (the
    coordinator) after rank 1 wrote its file; rank 1 loses its peer. The directory has files and no
    metadata: not a checkpoint any loader reads."""
    results = _results(worlds, False, "past_unpadded_end")
    for rank, r in enumerate(results):
        assert (r["phase"], r["error"]) == ("save", "ValueError: Failed to validate global plan"), (rank, r)
        assert r["rank_errors"][0] == "ValueError: Failed to validate global plan", (rank, r["rank_errors"])
        assert r["metadata_written"] is False, (rank, r["left_on_disk"])
    out_of_bounds = [(k, off, n, g) for k, off, n, g in results[1]["layout"] if off + n > g]
    assert out_of_bounds and {(off, n) for _, off, n, _ in out_of_bounds} == {(22952, 88)}, out_of_bounds
    assert SCENARIOS["past_unpadded_end"].bug_for(mcore_version).seen_in(results)


@pytest.mark.parametrize("case", CASES)
def test_patched_round_trip_is_exact_and_the_next_step_matches(worlds, case):
    for rank, r in enumerate(_results(worlds, True, case)):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        deltas = r["max_delta"]
        kinds = {"/".join(k.split("/")[:2]) if k.startswith("next/") else k.split("/")[0] for k in deltas}
        assert kinds == set(KINDS) | {f"next/{k}" for k in KINDS}, (rank, kinds)
        assert set(deltas.values()) == {0.0}, (rank, {k: d for k, d in deltas.items() if d})
        assert all(off + n <= g for _, off, n, g in r["layout"]), (rank, "a piece past its tensor")


def test_patched_rank_without_parameters_describes_empty_pieces_only(worlds):
    rank1 = worlds[True][1]["rank_without_parameters"]["layout"]
    assert rank1 and all(n == 0 for _, _, n, _ in rank1), rank1


def test_patched_pieces_cover_each_bucket_tensor_exactly(worlds):
    """Over the ranks, each bucket tensor's pieces tile it: no gap, no overlap, nothing past its end."""
    for case in CASES:
        pieces = {}
        for w in worlds[True]:
            for key, off, n, g in w[case]["layout"]:
                pieces.setdefault(key, (g, []))[1].append((off, n))
        for key, (g, spans) in pieces.items():
            spans = sorted(s for s in spans if s[1])  # an all-padding shard's piece is empty
            ends = [0] + [off + n for off, n in spans]
            assert [off for off, _ in spans] == ends[:-1] and ends[-1] == g, (case, key, spans, g)


def test_where_the_release_works_the_pieces_are_the_releases(worlds):
    """The same geometry saved with the fix off and on: every rank describes the same pieces."""
    for rank in range(2):
        off, on = worlds[False][rank]["release_layout"], worlds[True][rank]["release_layout"]
        assert off["error"] is None and set(off["max_delta"].values()) == {0.0}, (rank, off["error"])
        assert on["layout"] == off["layout"], rank


def test_probe(mcore_version):
    import megatron.core.optimizer.distrib_optimizer as m
    from mcore_ckpt_fixes.fixes.dp_reshardable_padding.runtime import core

    verdict, why = core.probe(m)  # the release's own method, even after apply
    assert verdict is True and "all padding" in why and "past the bucket's unpadded size" in why, why


def _described(rank, world, buckets):
    """The release's method on a stand-in of ``world`` data-parallel ranks (``buckets``: (size,
    unpadded size, this rank's parameter pieces) per bucket) whose state carries the fix's padding
    pieces: per bucket, this rank's pieces as (offset, length)."""
    import megatron.core.optimizer.distrib_optimizer as m

    from mcore_ckpt_fixes.engine.patching import original
    from mcore_ckpt_fixes.fixes.dp_reshardable_padding.runtime import core

    standin = core.optimizer_stand_in(rank, buckets, world=world)
    state = standin.get_parameter_state_dp_reshardable()
    standin.get_parameter_state_dp_reshardable = lambda: core._pad_to_unpadded_bucket_ends(standin, state)
    described = original(m.DistributedOptimizer, core.METHOD)(standin, {}, False)
    return [[(offset, length) for offset, length, _ in bucket] for bucket in core.pieces(described)]


def test_a_shard_with_no_parameter_inside_the_unpadded_size_is_one_padding_piece(mcore_version):
    """DP=4, bucket 0 of 16 elements (4 per rank), parameters [0, 7), unpadded size 10 (a bucket
    closed by a tied embedding at its aligned start): rank 2's shard [8, 12) holds no parameter but
    [8, 10) of the tensor; rank 3's [12, 16) none of it. Bucket 1 gives every rank a parameter piece
    to shape the padding like. Over the ranks the pieces tile [0, 10) exactly (DP=4 has no CPU world
    in the suite: the release's own method runs on stand-ins here)."""
    if mcore_version not in FIX.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is outside {FIX.affected}")
    own = {0: [(0, 4)], 1: [(0, 3)], 2: [], 3: []}
    spans = []
    for rank in range(4):
        bucket0, bucket1 = _described(rank, 4, [(16, 10, own[rank]), (8, 8, [(0, 2)])])
        assert bucket1 == [(rank * 2, 2)], (rank, bucket1)
        spans += [s for s in bucket0 if s[1]]
        if rank == 3:
            assert bucket0 == [(10, 0)], bucket0  # wholly in the end padding: an empty piece at the end
    assert sorted(spans) == [(0, 4), (4, 3), (7, 1), (8, 2)], spans


def test_a_rank_without_any_parameter_inside_the_unpadded_size_is_refused_in_one_line(mcore_version):
    if mcore_version not in FIX.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is outside {FIX.affected}")
    with pytest.raises(
        ValueError, match=r"^dp_reshardable: data-parallel rank 2 holds no parameter, so no state to shape its padding"
    ):
        _described(2, 4, [(16, 10, [])])
