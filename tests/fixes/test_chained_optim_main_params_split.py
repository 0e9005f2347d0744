"""chained-optim-main-params-split: both halves on every affected release line (0.16.1, 0.17.1),
one warm world each (4 gloo ranks, both cases); on 0.18.2 and 0.19.2 it is not needed.

A bf16 MoE GPT (local layers), Megatron's DDP and ``get_megatron_optimizer``'s ChainedOptimizer of a
dense and an expert distributed optimizer; the model loaded from a legacy per-rank checkpoint of
fp32 weights and the main parameters reloaded from it (``reload_model_params(state_dict=...)``, what
``--no-load-optim --load-main-params-from-ckpt`` does). ``one_chunk``: EP=2; ``two_chunks``: PP=2
with two virtual stages, EP=2. See mcore_ckpt_fixes/fixes/chained_optim_main_params_split/checks/core.py.
"""

import types

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.chained_optim_main_params_split import FIX
from mcore_ckpt_fixes.fixes.chained_optim_main_params_split.checks import scenarios as sc
from mcore_ckpt_fixes.testing import for_fix

CORE = "mcore_ckpt_fixes.fixes.chained_optim_main_params_split.checks.core"
MODULE = "megatron.core.optimizer.optimizer"
SCENARIOS = {s.name: s for s in for_fix(FIX.id)}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(
        FIX,
        f"{CORE}:cases",
        {"MCORE_CKPT_FIX_CHAINED_OPTIM_MAIN_PARAMS_SPLIT": "off"},
        tmp_path_factory,
        mcore_version,
        nproc=4,
    )


def test_unpatched_expert_main_params_keep_the_bf16_rounding(worlds, mcore_version):
    """One chunk: the reload completes; the dense optimizer's main parameters are the checkpoint's
    fp32 values, the expert optimizer's are exactly the bf16 model parameters, on every rank."""
    results = [r["one_chunk"] for r in worlds[False]]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        assert (r["phase"], r["error"]) == (sc.BF16_MAIN_PARAMS.phase, sc.BF16_MAIN_PARAMS.error), (
            rank,
            r.get("traceback"),
        )
        assert r["sub_optimizers"] == ["DistributedOptimizer", "DistributedOptimizer"], (rank, r["sub_optimizers"])
        wrong = {k for k, d in r["max_delta"].items() if d}
        assert wrong and wrong == {k for k in r["max_delta"] if k.startswith("expert/")}, (rank, r["max_delta"])
        assert sorted(r["bf16_rounded"]) == sorted(wrong), (rank, r["bf16_rounded"])
    assert SCENARIOS["one_chunk"].bug_for(mcore_version).seen_in(results)


def test_unpatched_two_chunks_run_past_the_last_chunk(worlds, mcore_version):
    results = [r["two_chunks"] for r in worlds[False]]
    for rank, r in enumerate(results):
        bug = sc.OFFSET_PAST_LAST_CHUNK
        assert (r["phase"], r["error"]) == (bug.phase, bug.error), (rank, r.get("traceback"))
    assert SCENARIOS["two_chunks"].bug_for(mcore_version).seen_in(results)


@pytest.mark.parametrize("case", ["one_chunk", "two_chunks"])
def test_patched_every_sub_optimizer_holds_the_checkpoints_fp32_values(worlds, case):
    for rank, r in enumerate(w[case] for w in worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["sub_optimizers"] == ["DistributedOptimizer", "DistributedOptimizer"], (rank, r["sub_optimizers"])
        kinds = {k.split("/")[0] for k in r["max_delta"]}
        chunks = {k.split("/")[1] for k in r["max_delta"]}
        assert kinds == {"dense", "expert"}, (rank, kinds)
        assert chunks == ({"0"} if case == "one_chunk" else {"0", "1"}), (rank, chunks)
        assert set(r["max_delta"].values()) == {0.0}, (rank, {k: d for k, d in r["max_delta"].items() if d})


def _chained(module, chunks, subs):
    chained = object.__new__(module.ChainedOptimizer)
    chained.model_chunks = list(chunks)
    chained.chained_optimizers = subs
    return chained


def test_calls_of_another_shape_keep_the_release_split(mcore_version):
    """Where the helper does not recognise the call, the release's own split decides."""
    if mcore_version not in FIX.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is outside {FIX.affected}")
    import mcore_ckpt_fixes
    import megatron.core.optimizer.optimizer as m
    from mcore_ckpt_fixes.fixes.chained_optim_main_params_split.runtime.core import _state_dicts_by_own_chunks as split

    mcore_ckpt_fixes.apply()
    a, b = object(), object()
    # A sub-optimizer without model_chunks (Float16Optimizer, FP32Optimizer): not recognised.
    no_chunks = _chained(m, [a], [types.SimpleNamespace(model_chunks=[a]), types.SimpleNamespace()])
    assert split(no_chunks, {"model": 1}) is None
    assert no_chunks._split_state_dict({"model": 1}) == [{"model": 1}, None]  # the release's
    # A chunk key missing: the release's assertion, unchanged.
    two = _chained(m, [a, b], [types.SimpleNamespace(model_chunks=[a, b])])
    assert split(two, {"model0": 1}) is None
    with pytest.raises(AssertionError, match="cannot find 'model1'"):
        two._split_state_dict({"model0": 1})
    # Sub-optimizers that each cover their own chunk: by identity, renumbered from 0.
    own = _chained(m, [a, b], [types.SimpleNamespace(model_chunks=[b]), types.SimpleNamespace(model_chunks=[a])])
    assert own._split_state_dict({"model_0": "A", "model_1": "B"}) == [{"model_0": "B"}, {"model_0": "A"}]
    assert own._split_state_dict(None) == [None, None]
