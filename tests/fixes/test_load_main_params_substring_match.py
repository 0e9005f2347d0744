"""load-main-params-substring-match: both halves on the affected release line (0.16.1), one warm
world each (2 gloo ranks, both cases); on 0.17.1 and later the release matches by name itself (not
needed: the probe says so).

A bf16 MoE GPT whose experts are Megatron's ``TEGroupedMLP`` with 12 local experts per rank (its
grouped linears stood in: no Transformer Engine on CPU), Megatron's DDP and
``get_megatron_optimizer``'s optimizer (``grouped_experts``: EP=1, one distributed optimizer;
``grouped_experts_ep2``: EP=2, a dense and an expert one); the model loaded from a legacy per-rank
checkpoint of fp32 weights and the main parameters reloaded from it
(``reload_model_params(state_dict=...)``, what ``--no-load-optim --load-main-params-from-ckpt`` does).
See mcore_ckpt_fixes/fixes/load_main_params_substring_match/checks/core.py.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.load_main_params_substring_match import FIX
from mcore_ckpt_fixes.fixes.load_main_params_substring_match.checks import scenarios as sc
from mcore_ckpt_fixes.fixes.load_main_params_substring_match.runtime.core import _state_dict_keys_naming as naming
from mcore_ckpt_fixes.testing import for_fix

CORE = "mcore_ckpt_fixes.fixes.load_main_params_substring_match.checks.core"
MODULE = "megatron.core.optimizer.distrib_optimizer"
EXPERTS = "decoder.layers.0.mlp.experts"
# Per case, the sub-optimizers get_megatron_optimizer builds (the grouped weights are in the last).
CASES = {"grouped_experts": ("dense",), "grouped_experts_ep2": ("dense", "expert")}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:cases", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


@pytest.mark.parametrize("case", CASES)
def test_unpatched_weight1_matches_weight10_and_weight11(worlds, mcore_version, case):
    """The first distributed optimizer stops on the first grouped weight whose name is part of others."""
    results = [r[case] for r in worlds[False]]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        assert (r["phase"], r["error"]) == (sc.THREE_MATCHES.phase, sc.THREE_MATCHES.error), (rank, r.get("traceback"))
        assert "_build_model_param_to_state_dict_param_map" in r["traceback"], rank
    assert for_fix(FIX.id)[0].bug_for(mcore_version).seen_in(results)


@pytest.mark.parametrize("case", CASES)
def test_patched_every_sub_optimizer_holds_the_checkpoints_fp32_values(worlds, case):
    kinds = CASES[case]
    grouped = {f"{EXPERTS}.linear_fc{n}.weight{i}" for n in (1, 2) for i in range(12)}
    experts = set()  # each rank's shards: together, every grouped weight
    for rank, r in enumerate(w[case] for w in worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["sub_optimizers"] == ["DistributedOptimizer"] * len(kinds), (rank, r["sub_optimizers"])
        assert {k.split("/")[0] for k in r["max_delta"]} == set(kinds), (rank, sorted(r["max_delta"]))
        assert set(r["max_delta"].values()) == {0.0}, (rank, {k: d for k, d in r["max_delta"].items() if d})
        experts |= {k.split("/", 2)[2] for k in r["max_delta"] if k.startswith(f"{kinds[-1]}/") and ".experts." in k}
    assert experts == grouped, sorted(experts ^ grouped)


def test_a_parameter_takes_the_key_that_names_it():
    keys = {f"e.weight{i}" for i in range(12)}
    assert naming("e.weight1", keys) == ["e.weight1"]
    assert naming("e.weight11", keys) == ["e.weight11"]
    # Keys with a prefix (a state dict saved around the model): the one ending with "." + name.
    prefixed = {f"module.{k}" for k in keys}
    assert naming("e.weight1", prefixed) == ["module.e.weight1"]


def test_anything_else_keeps_the_release_matches():
    assert naming("a.w", {"x.a.w_scale"}) == ["x.a.w_scale"]  # one match: the release's, whatever it is
    assert naming("a.w", {"b.c"}) == []  # none: the release's assertion
    # Several, none naming the parameter, or two naming it under different prefixes: still several.
    assert sorted(naming("a.w", {"a.w1", "a.w2"})) == ["a.w1", "a.w2"]
    assert sorted(naming("a.w", {"m.a.w", "n.a.w"})) == ["m.a.w", "n.a.w"]


@pytest.mark.parametrize("layout", ["prefixed_keys", "two_chunks"])
def test_replacement_maps_as_the_release_where_it_maps(mcore_version, layout):
    """Where the release maps every parameter, the fix maps them to the same tensors."""
    if mcore_version not in FIX.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is outside {FIX.affected}")
    import megatron.core.optimizer.distrib_optimizer as m

    from mcore_ckpt_fixes.engine.patching import original
    from mcore_ckpt_fixes.fixes.load_main_params_substring_match.runtime import core

    names = ["embedding.weight", "decoder.layers.0.mlp.linear_fc1.weight", "output_layer.weight"]
    opt = object.__new__(m.DistributedOptimizer)
    if layout == "prefixed_keys":
        opt.model_chunks = [core.ProbeModelChunk(names)]
        state_dict = {"model": {f"module.{n}": core.ProbeTensor() for n in names}}
    else:
        opt.model_chunks = [core.ProbeModelChunk(names), core.ProbeModelChunk(names)]
        state_dict = {f"model{i}": {n: core.ProbeTensor() for n in names} for i in range(2)}
    release = original(m.DistributedOptimizer, core.METHOD)(opt, state_dict)
    assert len(release) == len(names) * len(opt.model_chunks)
    assert core.build_model_param_to_state_dict_param_map(opt, state_dict) == release
