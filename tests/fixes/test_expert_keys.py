"""expert-keys: both halves on every release line (0.16.1 - 0.19.2 are all affected).

Round trips: real parallel_state (EP=2), the real Megatron-FSDP mesh construction, real
``make_fsdp_dtensor``, the release's fsdp_dtensor preprocessing (``megatron.training.checkpointing``
from 0.17, the same ``megatron.core`` steps on 0.16), the optimizer's real parameter naming, real
torch DCP save/load. Built by hand: the model, because its experts are Transformer Engine's grouped
MLP (``linear_fc1.weight{i}`` / ``bias{i}``), and TE (and Megatron-FSDP's CUDA buffers) cannot run on
a CPU host: the keys and DTensors are made exactly as Megatron-FSDP names and shards them; see
mcore_ckpt_fixes/fixes/expert_keys/checks/core.py.
"""

import pytest

from conftest import check_py
from mcore_ckpt_fixes.fixes.expert_keys import FIX
from mcore_ckpt_fixes.testing.launcher import run_world, values
from mcore_ckpt_fixes.testing import for_fix

SC = "mcore_ckpt_fixes.fixes.expert_keys.checks.core"
SCENARIOS = {s.name: s for s in for_fix(FIX.id)}
INDEXED = ("ep2", "ep2_dp2")  # one tensor per local expert (weight{i}, bias{i})
GROUPED = ("ep2_grouped", "ep2_grouped_bias", "ep2_dp2_grouped")  # single grouped tensors (0.18+)
MODULE = "megatron.core.transformer.fsdp_dtensor_checkpoint"
TRAINING = "megatron.training.checkpointing"
EXP = "decoder.layers.0.mlp.experts."
BIASES = [f"linear_fc{f}.bias{i}" for f in (1, 2) for i in (0, 1)]
# Every expert bias tensor of the layer, model and Adam state, as the scenario names them.
BIAS_KEYS = sorted(
    [f"model/{EXP}{b}" for b in BIASES] + [f"optimizer/{EXP}{b}/{s}" for b in BIASES for s in ("exp_avg", "exp_avg_sq")]
)


@pytest.fixture(scope="module", autouse=True)
def warm_parent():
    from mcore_ckpt_fixes.fixes.expert_keys.checks.core import prepare

    prepare()


def _run(name, patched, tmp_path):
    s = SCENARIOS[name]
    env = {} if patched else {"MCORE_CKPT_FIXES": "off"}
    return values(
        run_world(s.func, s.nproc, {"ckpt_dir": str(tmp_path), "patched": patched}, env=env, timeout=s.timeout)
    )


@pytest.mark.parametrize("name", INDEXED)
def test_unpatched_ep_rank_0_loads_ep_rank_1_biases(name, tmp_path, mcore_version):
    assert mcore_version in FIX.specifiers  # every tested release line is affected
    results = _run(name, False, tmp_path)
    coords = results[0]["coords"]  # rank -> (ep rank, expert-dp rank, dense-dp rank)
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r["fix_state"])
        assert r["n_tensors"] == 33 and r["phase"] in (None, "compare"), (rank, r["error"], r.get("traceback"))
        ep_rank, edp_rank, _ = coords[rank]
        if ep_rank == 0:
            # Exactly the expert biases differ, and each holds what EP rank 1 (same expert-DP
            # position) saved: that rank's experts 2 and 3, loaded as experts 0 and 1.
            twin = next(t for t, c in enumerate(coords) if c[:2] == [1, edp_rank] or c[:2] == (1, edp_rank))
            assert sorted(k for k, d in r["max_delta"].items() if d != 0.0) == BIAS_KEYS, (rank, r["max_delta"])
            assert r["loaded_from"] == {k: [twin] for k in BIAS_KEYS}, (rank, r["loaded_from"])
        else:
            assert r["error"] is None and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
    assert SCENARIOS[name].bug.seen_in(results)  # selftest's judgement agrees


@pytest.mark.parametrize("name", INDEXED)
def test_patched_round_trip_is_exact(name, tmp_path, mcore_version):
    results = _run(name, True, tmp_path)
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["n_tensors"] == 33 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        ep_rank = r["coords"][rank][0]
        # The keys written are global: EP rank 1 writes experts 2 and 3, weights and biases alike.
        want = {f"{EXP}linear_fc{f}.{p}{2 * ep_rank + i}" for f in (1, 2) for p in ("weight", "bias") for i in (0, 1)}
        assert want == {k for k in r["saved_keys"] if ".experts." in k}, (rank, r["saved_keys"])
        assert r["via"].startswith("megatron.training" if mcore_version.release[:2] >= (0, 17) else "megatron.core")
        assert r["raw_state_kept"] is True


# -- single grouped expert tensors (moe_single_grouped_weight / _bias, 0.18+) ---------------------

GROUPED_PARAMS = {
    "ep2_grouped": ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias"),
    "ep2_dp2_grouped": ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias"),
    "ep2_grouped_bias": ("linear_fc1.bias", "linear_fc2.bias"),
}
# Global shapes of all 4 experts (hidden 4, ffn 6); each EP rank holds 2 of them on dim 0.
GLOBAL_SHAPES = {
    "linear_fc1.weight": [4, 6, 4],
    "linear_fc1.bias": [4, 6],
    "linear_fc2.weight": [4, 4, 6],
    "linear_fc2.bias": [4, 4],
}


def _grouped_or_skip(name):
    why = SCENARIOS[name].absent()
    if why is not None:  # 0.16/0.17: Megatron-Core has no single grouped expert tensors
        pytest.skip(f"single grouped expert tensors do not exist in this release: {why}")


@pytest.mark.parametrize("name", GROUPED)
def test_unpatched_single_grouped_experts(name, tmp_path, mcore_version):
    """Unpatched: a grouped weight stops the optimizer's parameter naming with upstream's assertion
    on every rank; a grouped bias beside indexed weights saves, and each EP-rank-0 rank loads EP rank
    1's biases (model and Adam state), silently."""
    _grouped_or_skip(name)
    results = _run(name, False, tmp_path)
    bug = SCENARIOS[name].bug_for(mcore_version)
    assert bug.seen_in(results)
    if bug.kind == "raises":
        for rank, r in enumerate(results):
            assert (r["phase"], r["error"]) == (bug.phase, bug.error), (rank, r["phase"], r["error"])
        return
    coords = results[0]["coords"]
    biases = sorted(
        [f"model/{EXP}{b}" for b in GROUPED_PARAMS[name]]
        + [f"optimizer/{EXP}{b}/{s}" for b in GROUPED_PARAMS[name] for s in ("exp_avg", "exp_avg_sq")]
    )
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled", TRAINING: "disabled"} and r["n_tensors"] == 27, (rank, r)
        # both EP ranks stored the grouped bias under one key with their local shape
        assert {k: r["stored_shapes"][f"{EXP}{k}"] for k in GROUPED_PARAMS[name]} == {
            k: [2, *GLOBAL_SHAPES[k][1:]] for k in GROUPED_PARAMS[name]
        }, r["stored_shapes"]
        if coords[rank][0] == 0:
            assert sorted(k for k, d in r["max_delta"].items() if d != 0.0) == biases, (rank, r["max_delta"])
            assert r["loaded_from"] == {k: [1] for k in biases}, (rank, r["loaded_from"])
        else:
            assert r["error"] is None and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])


@pytest.mark.parametrize("name", GROUPED)
def test_patched_single_grouped_experts_round_trip_exactly(name, tmp_path):
    """Patched: the key stays, the checkpoint holds one global tensor of all 4 experts, each EP rank
    writes and loads its own rows (over uneven, one of them empty, expert-DP shards in world 4)."""
    _grouped_or_skip(name)
    results = _run(name, True, tmp_path)
    n = 21 if name != "ep2_grouped_bias" else 27
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["n_tensors"] == n and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
        assert r["fix_state"] == {MODULE: "applied", TRAINING: "applied"}, (rank, r["fix_state"])
        assert {k: r["stored_shapes"][f"{EXP}{k}"] for k in GROUPED_PARAMS[name]} == {
            k: GLOBAL_SHAPES[k] for k in GROUPED_PARAMS[name]
        }, r["stored_shapes"]
        assert r["raw_state_kept"] is True


# -- the replacement's contract, in this process (EP layout set through parallel_state's setters) ---


@pytest.fixture
def ep():
    import mcore_ckpt_fixes
    from megatron.core import parallel_state as ps

    import megatron.core.transformer.fsdp_dtensor_checkpoint  # noqa: F401

    mcore_ckpt_fixes.apply()

    def set_ep(size, rank):
        ps.set_expert_model_parallel_world_size(size)
        ps.set_expert_model_parallel_rank(rank)

    yield set_ep
    set_ep(None, None)


def _mod():
    import sys

    from mcore_ckpt_fixes.fixes.expert_keys.runtime import core as patch

    mod = sys.modules[MODULE]
    assert mod.handle_experts_in_state_dict is patch.handle_experts_in_state_dict
    return mod


def test_renames_weights_biases_swiglu_halves_and_sequential(ep):
    ep(2, 1)
    keys = [
        f"{EXP}linear_fc1.weight0",
        f"{EXP}linear_fc1.bias1",
        f"{EXP}linear_fc1.weight1_w",
        f"{EXP}linear_fc1.bias0_v",
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.bias",
        "decoder.layers.0.mlp.router.weight",
        f"module.module.{EXP}linear_fc2.bias0",
    ]
    out = _mod().handle_experts_in_state_dict({k: i for i, k in enumerate(keys)}, 4)
    assert list(out.items()) == [
        (f"{EXP}linear_fc1.weight2", 0),
        (f"{EXP}linear_fc1.bias3", 1),
        (f"{EXP}linear_fc1.weight3_w", 2),
        (f"{EXP}linear_fc1.bias2_v", 3),
        ("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.bias", 4),
        ("decoder.layers.0.mlp.router.weight", 5),
        (f"module.module.{EXP}linear_fc2.bias2", 6),
    ]
    assert _mod().handle_experts_in_state_dict(out, 4) == out  # already global: unchanged
    assert _mod().get_expert_index_from_key(f"{EXP}linear_fc2.bias1") == 1
    # Back to the local parameter (handle_swiglu_in_state_dict's optimizer path needs it for biases).
    assert _mod().expert_param_local_key(f"{EXP}linear_fc1.bias3", 4) == f"{EXP}linear_fc1.bias1"
    assert _mod().expert_param_local_key(f"{EXP}linear_fc1.weight2_w", 4) == f"{EXP}linear_fc1.weight0_w"


def test_two_digit_indices(ep):
    ep(2, 1)  # 24 experts, 12 local: local 1 -> 13 and local 10 -> 22 (str.replace would mangle 10)
    out = _mod().handle_experts_in_state_dict({f"{EXP}linear_fc1.weight1": 1, f"{EXP}linear_fc1.weight10": 10}, 24)
    assert out == {f"{EXP}linear_fc1.weight13": 1, f"{EXP}linear_fc1.weight22": 10}


def test_uninitialised_parallel_state_is_one_ep_rank(ep):
    """A single-process script (checkpoint conversion) with parallel_state not initialised: the EP
    size reads 0 there, upstream's get_ep_layer_offset divides by it; the fix treats it as EP = 1."""
    import torch.distributed as dist

    ep(None, None)
    assert not dist.is_initialized()
    state = {f"{EXP}linear_fc1.weight1": 0, f"{EXP}linear_fc2.bias0": 1, "decoder.layers.0.mlp.router.weight": 2}
    assert list(_mod().handle_experts_in_state_dict(state, 4).items()) == list(state.items())
    assert _mod().expert_param_local_key(f"{EXP}linear_fc2.bias3", 4) == f"{EXP}linear_fc2.bias3"


def test_num_experts_none_is_one_clear_error(ep):
    ep(1, 0)
    with pytest.raises(ValueError) as info:
        _mod().handle_experts_in_state_dict({f"{EXP}linear_fc1.weight0": 0}, None)
    assert str(info.value) == (
        f"handle_experts_in_state_dict: num_experts=None but the state dict has expert keys (e.g. "
        f"'{EXP}linear_fc1.weight0'); pass the model's total number of experts (config.num_moe_experts, an int > 0)"
    )
    # A dense model (no expert keys) is unaffected: get_global_unique_param_name passes None for it.
    assert _mod().handle_experts_in_state_dict({"decoder.layers.0.mlp.linear_fc1.weight": 0}, None) == {
        "decoder.layers.0.mlp.linear_fc1.weight": 0
    }


def test_single_grouped_tensor(ep):
    single = {f"{EXP}linear_fc1.weight": 0, f"{EXP}linear_fc2.bias": 1}
    ep(1, 0)  # EP = 1: the grouped tensor holds every expert, the key is already global
    assert _mod().handle_experts_in_state_dict(single, 4) == single
    assert _mod().get_expert_index_from_key(f"{EXP}linear_fc1.weight") is None
    ep(2, 1)  # EP > 1: the key stays too (the tensor, not the key, is made EP-global at preprocessing)
    assert _mod().handle_experts_in_state_dict(single, 4) == single
    # A SwiGLU half of a grouped tensor under EP: refused, one line, naming the key, the setting and
    # what is accepted.
    with pytest.raises(ValueError) as info:
        _mod().handle_experts_in_state_dict({f"{EXP}linear_fc1.weight_w": 0}, 4)
    msg = str(info.value)
    assert "\n" not in msg and f"'{EXP}linear_fc1.weight_w'" in msg and "expert_model_parallel_size=2" in msg
    assert "moe_single_grouped_weight=False" in msg and "expert_model_parallel_size=1" in msg


def test_probe_and_status(mcore_version):
    import mcore_ckpt_fixes
    import megatron.core.transformer.fsdp_dtensor_checkpoint as m
    from mcore_ckpt_fixes.fixes.expert_keys.runtime import core as patch

    mcore_ckpt_fixes.apply()
    row = next(r for r in mcore_ckpt_fixes.report() if r["id"] == FIX.id)
    assert row["state"] == "applied", row
    verdict, why = patch.probe(m)  # judges the release's own functions even after apply
    assert verdict is True and why.startswith("expert biases keep their local index under EP"), why
    assert (
        "num_experts=None drops every expert key" in why and "a single grouped expert tensor (no index) asserts" in why
    )
    if mcore_version.release[:2] >= (0, 17):  # megatron.training ships in the wheel
        import megatron.training.checkpointing as t

        assert row["targets"][TRAINING]["state"] == "applied", row["targets"]
        verdict, why = patch.probe_training(t)
        assert verdict is True and why.startswith("a single grouped expert tensor keeps its EP-local shape (2, 2)"), why


ALIASES = r"""
import sys
import megatron.core.transformer.fsdp_dtensor_checkpoint as m
import megatron.core.optimizer.distrib_optimizer as d
sites = {"distrib_optimizer": d}
try:
    import megatron.training.checkpointing as c
    sites["training.checkpointing"] = c
except ImportError:
    assert sys.version_info < (3, 12)  # 0.16 wheels do not ship megatron.training
upstream = m.handle_experts_in_state_dict
import megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor as u
import megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard
fs = sys.modules["megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard"]  # the package exports a function of that name
upstream_pre = u.preprocess_state_dict_for_uneven_dtensor
# a user module that imported the names before the fix
from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict as user_alias
from megatron.core.transformer.fsdp_dtensor_checkpoint import expert_param_local_key as user_local

import mcore_ckpt_fixes
from mcore_ckpt_fixes.fixes.expert_keys.runtime import core as ek
g = globals()
for name, mod in sites.items():
    assert mod.handle_experts_in_state_dict is ek.handle_experts_in_state_dict, name
assert m.handle_experts_in_state_dict is ek.handle_experts_in_state_dict
assert g["user_alias"] is ek.handle_experts_in_state_dict and g["user_local"] is ek.expert_param_local_key
# the uneven-DTensor preprocessing: replaced where megatron.training calls it, nowhere else
if "training.checkpointing" in sites:
    assert c.preprocess_state_dict_for_uneven_dtensor is ek.preprocess_state_dict_for_uneven_dtensor
assert u.preprocess_state_dict_for_uneven_dtensor is upstream_pre and fs.preprocess_state_dict_for_uneven_dtensor is upstream_pre
mcore_ckpt_fixes.revert()
for name, mod in sites.items():
    assert mod.handle_experts_in_state_dict is upstream, name
if "training.checkpointing" in sites:
    assert c.preprocess_state_dict_for_uneven_dtensor is upstream_pre
assert g["user_alias"] is upstream
mcore_ckpt_fixes.apply()
assert d.handle_experts_in_state_dict is ek.handle_experts_in_state_dict
print("OK", sorted(sites))
"""

LATE_ALIAS = r"""
import mcore_ckpt_fixes
import megatron.core.transformer.fsdp_dtensor_checkpoint as m
from megatron.core import parallel_state as ps
from mcore_ckpt_fixes.fixes.expert_keys.runtime import core as ek
# imported after the fix: binds our function by name, which revert() does not know about
import megatron.core.optimizer.distrib_optimizer as d
assert d.handle_experts_in_state_dict is ek.handle_experts_in_state_dict
ps.set_expert_model_parallel_world_size(2); ps.set_expert_model_parallel_rank(1)
k = "decoder.layers.0.mlp.experts.linear_fc1.bias0"
assert list(d.handle_experts_in_state_dict({k: 0}, 4)) == [k.replace("bias0", "bias2")]
mcore_ckpt_fixes.revert()  # the stale copy now behaves as upstream's: biases keep their index
assert list(d.handle_experts_in_state_dict({k: 0}, 4)) == [k]
mcore_ckpt_fixes.apply()
assert list(d.handle_experts_in_state_dict({k: 0}, 4)) == [k.replace("bias0", "bias2")]
print("OK")
"""


def test_aliases_rebound_and_restored(mcore_version):
    out = check_py(ALIASES)
    sites = (
        "['distrib_optimizer', 'training.checkpointing']"
        if mcore_version.release[:2] >= (0, 17)
        else "['distrib_optimizer']"
    )
    assert out.strip().endswith(f"OK {sites}"), out


@pytest.mark.one_line  # the engine's rebinding, reload, pickle and revert, which tests/engine/test_lifecycle.py checks for every fix on every line
def test_alias_imported_after_the_fix_follows_revert():
    assert check_py(LATE_ALIAS).strip().endswith("OK")


# -- a fixed load of a checkpoint an unfixed release wrote: warned, never silent ---------------------

OLD_LAYOUT = "this fsdp_dtensor checkpoint has the expert-bias layout of an unfixed Megatron-Core"


def _save_then_load(tmp_path, save_patched, variant="indexed"):
    timeout = SCENARIOS["ep2"].timeout
    kw = {"ckpt_dir": str(tmp_path), "variant": variant}
    saved = values(
        run_world(
            f"{SC}:save_ep2",
            2,
            {**kw, "patched": save_patched},
            env={} if save_patched else {"MCORE_CKPT_FIXES": "off"},
            timeout=timeout,
        )
    )
    loaded = values(run_world(f"{SC}:load_ep2", 2, {**kw, "patched": True}, env={}, timeout=timeout))
    return saved, loaded


def test_fixed_load_of_unfixed_checkpoint_warns_and_names_missing_keys(tmp_path, mcore_version):
    """Covers every release line: on 0.17+ through the name megatron.training.checkpointing binds
    (what _load_base_checkpoint calls), on 0.16 (no megatron.training in the wheel) the megatron.core one."""
    saved, loaded = _save_then_load(tmp_path, save_patched=False)
    assert {s["fix_state"][MODULE] for s in saved} == {"disabled"}
    # the unfixed layout: both EP ranks wrote bias0/bias1
    assert all(
        {k for k in s["saved_keys"] if ".bias" in k and ".experts." in k} == {f"{EXP}{b}" for b in BIASES}
        for s in saved
    ), saved
    site = "megatron.training.checkpointing" if mcore_version.release[:2] >= (0, 17) else MODULE
    for rank, r in enumerate(loaded):
        assert r["fix_state"] == {MODULE: "applied"} and r["site"] == site, (rank, r)
        assert len(r["warnings"]) == 1, (rank, r["warnings"])
        msg = r["warnings"][0]
        assert msg.startswith(f"expert-keys: {OLD_LAYOUT}"), msg
        assert "expert biases are stored under local indices" in msg and "only one EP rank's copy" in msg, msg
        assert f"EP rank {r['ep_rank']} of 2" in msg, msg
        if r["ep_rank"] == 0:
            assert r["not_in_checkpoint"] == [] and r["not_loaded"] == [], (rank, r)
            assert "load that one saved copy" in msg, msg
        else:
            # EP rank 1 asks for its global biases 2 and 3 (model and Adam state): none is there.
            want = sorted(
                [f"model.{EXP}linear_fc{f}.bias{i}" for f in (1, 2) for i in (2, 3)]
                + [
                    f"optimizer.state.module.module.{EXP}linear_fc{f}.bias{i}.{s}"
                    for f in (1, 2)
                    for i in (2, 3)
                    for s in ("exp_avg", "exp_avg_sq", "step")
                ]
            )
            assert r["not_in_checkpoint"] == want, (rank, r["not_in_checkpoint"])
            assert f"{len(want)} expert bias keys are not in the checkpoint" in msg, msg
            for key in want:
                assert repr(key) in msg, (key, msg)
            # What the warning is about: those tensors kept their initial values.
            assert r["not_loaded"] == BIAS_KEYS, (rank, r["not_loaded"])


def test_fixed_load_of_fixed_checkpoint_does_not_warn(tmp_path):
    saved, loaded = _save_then_load(tmp_path, save_patched=True)
    assert {s["fix_state"][MODULE] for s in saved} == {"applied"}
    for rank, r in enumerate(loaded):
        assert r["warnings"] == [] and r["not_in_checkpoint"] == [] and r["not_loaded"] == [], (rank, r)


OLD_GROUPED = (
    "this fsdp_dtensor checkpoint stores single grouped expert tensors in the layout of an unfixed Megatron-Core"
)


@pytest.mark.parametrize("save_patched", [False, True], ids=["unfixed-save", "fixed-save"])
def test_fixed_load_of_grouped_bias_checkpoint(save_patched, tmp_path):
    """A grouped bias (moe_single_grouped_bias) beside indexed weights, EP=2, saved with the fix off
    or on, loaded with it on through megatron.training's partial fsdp_dtensor load. The unfixed
    checkpoint holds one EP rank's (2, ...) biases where the fixed load asks for (4, ...): EP rank 0
    loads that copy (it is EP rank 1's), EP rank 1 keeps its values, both are told. A fixed
    checkpoint loads exactly, without a warning."""
    _grouped_or_skip("ep2_grouped_bias")
    saved, loaded = _save_then_load(tmp_path, save_patched, variant="grouped_bias")
    assert {s["fix_state"][MODULE] for s in saved} == {"applied" if save_patched else "disabled"}
    biases = sorted(
        [f"model/{EXP}linear_fc{f}.bias" for f in (1, 2)]
        + [f"optimizer/{EXP}linear_fc{f}.bias/{s}" for f in (1, 2) for s in ("exp_avg", "exp_avg_sq")]
    )
    for rank, r in enumerate(loaded):
        assert r["not_in_checkpoint"] == [], (rank, r["not_in_checkpoint"])
        if save_patched:
            assert r["warnings"] == [] and r["not_loaded"] == [] and r["loaded_from"] == {}, (rank, r)
            continue
        assert len(r["warnings"]) == 1, (rank, r["warnings"])
        msg = r["warnings"][0]
        assert msg.startswith(f"expert-keys: {OLD_GROUPED}: "), msg
        assert f"EP rank {r['ep_rank']} of 2" in msg and "6 tensors" in msg and "(2, 6)" in msg and "(4, 6)" in msg, msg
        for key in (
            "model.decoder.layers.0.mlp.experts.linear_fc1.bias",
            "optimizer.state.module.module.decoder.layers.0.mlp.experts.linear_fc2.bias.exp_avg_sq",
        ):
            assert repr(key) in msg, (key, msg)
        if r["ep_rank"] == 0:
            assert "loads that one saved copy" in msg, msg
            assert r["not_loaded"] == [] and r["loaded_from"] == {k: [1] for k in biases}, (rank, r)
        else:
            assert "keep their current values (not loaded)" in msg, msg
            assert r["not_loaded"] == biases and r["loaded_from"] == {}, (rank, r)


@pytest.mark.parametrize("save_patched", [False, True], ids=["unfixed-save", "fixed-save"])
def test_doctor_on_grouped_bias_checkpoint(save_patched, tmp_path):
    """``inspect`` tells the two layouts apart from the shapes in the metadata: the unfixed grouped
    bias holds 2 of the layer's 4 experts (the router has 4 rows)."""
    from mcore_ckpt_fixes.doctor import diagnose

    _grouped_or_skip("ep2_grouped_bias")
    saved = values(
        run_world(
            f"{SC}:save_ep2",
            2,
            {"ckpt_dir": str(tmp_path), "patched": save_patched, "variant": "grouped_bias"},
            env={} if save_patched else {"MCORE_CKPT_FIXES": "off"},
            timeout=SCENARIOS["ep2"].timeout,
        )
    )
    assert len(saved) == 2
    r = diagnose(str(tmp_path))
    assert "6 single grouped expert tensors" in r["experts"], r["experts"]
    if save_patched:
        assert r.ok, r.problems
        return
    found = sorted(p["message"].split(":")[0] for p in r.problems if p["code"] == "expert-key-collision")
    assert [p["code"] for p in r.problems] == ["expert-key-collision"] * 6, r.problems
    assert found == sorted(
        [f"model.{EXP}linear_fc{f}.bias" for f in (1, 2)]
        + [
            f"optimizer.state.module.module.{EXP}linear_fc{f}.bias.{s}"
            for f in (1, 2)
            for s in ("exp_avg", "exp_avg_sq")
        ]
    )
    # findings come in key order: the first is the model's fc1 bias (ffn 6)
    assert r.problems[0]["message"].startswith(
        f"model.{EXP}linear_fc1.bias: one grouped tensor of 2 experts (shape [2, 6]) where the layer has 4 "
        f"(rows of model.decoder.layers.0.mlp.router.weight): each EP rank wrote its own experts"
    )
