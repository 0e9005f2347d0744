"""model-load-fallback: both halves on 0.17.1, 0.18.2 and 0.19.2, one warm world each; not applicable
on 0.16.1 (no megatron.training in the wheel).

World 2 (gloo on CPU): the resume check's dense GPT (DP=2, distributed optimizer, tied embeddings),
one step, saved by megatron.training's save_checkpoint in torch_dist and in the legacy torch format,
then loaded by load_checkpoint into a newly built job: as saved (legacy), and fine-tuned with the
output layer untied (--untie-embeddings-and-output-weights --finetune: the checkpoint has no
output_layer.weight) from each format, under torch_dist's default strictness, log_all and ignore_all.
The fix-off half turns off this fix alone. See mcore_ckpt_fixes/fixes/model_load_fallback/checks/core.py.
"""

import logging

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.model_load_fallback import FIX
from mcore_ckpt_fixes.fixes.model_load_fallback.checks import scenarios as sc

CORE = "mcore_ckpt_fixes.fixes.model_load_fallback.checks.core"
MODULE = "megatron.training.checkpointing"
OUTPUT = "param:module.output_layer.weight"
# The ways the job loads (checks/core.py's WAYS, by name).
AS_SAVED, LEGACY_UNTIED, DIST_UNTIED, LOG_ALL, IGNORE_ALL = (
    "torch",
    "torch untied",
    "torch_dist untied",
    "torch_dist untied log_all",
    "torch_dist untied ignore_all",
)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def _refusal(rank):
    return (
        f"RuntimeError: rank {rank}: the checkpoint lacks 1 of this model's weights (['output_layer.weight']; "
        "0 keys of the checkpoint unused): load_checkpoint would train on with them at their initial values. "
        "Accepted: a checkpoint that has them, or --dist-ckpt-strictness log_all / ignore_all to go on without "
        "them (named in a warning)"
    )


def _warning(rank, strictness):
    return (
        f"rank {rank}: the checkpoint lacks 1 of this model's weights, which keep their initial values "
        f"(--dist-ckpt-strictness {strictness}): ['output_layer.weight']"
    )


def _exact(r, way):
    compared = {k: v for k, v in r["max_delta"].items() if k.startswith(f"{way}/")}
    return compared and set(compared.values()) == {0.0}


def test_unpatched_every_rank_trains_on_from_the_initial_output_layer(worlds, mcore_version):
    for rank, r in enumerate(worlds[False]):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        assert (r["phase"], r["error"]) == ("load", sc.SILENT), (rank, r["error"], r.get("traceback"))
        # The legacy load and ignore_all: no error, no log, the output layer at its random start.
        for way in (LEGACY_UNTIED, IGNORE_ALL, LOG_ALL):
            assert r["outcomes"][way] == "ok", (rank, way, r["outcomes"])
            assert r["kept_initial"][way] == [OUTPUT], (rank, way, r["kept_initial"])
            assert _exact(r, way), (way, r["max_delta"])  # every weight the checkpoint has: loaded
        assert r["logged"][LEGACY_UNTIED] == r["logged"][IGNORE_ALL] == {"fix": [], "release": []}, r["logged"]
        # log_all: dist_checkpointing names the key the model asked for and the checkpoint lacks.
        (said,) = r["logged"][LOG_ALL]["release"]
        assert "Unexpected keys (for this rank): {'output_layer.weight'}" in said, said
        assert r["logged"][LOG_ALL]["fix"] == [], r["logged"][LOG_ALL]
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False])


def test_patched_refuses_the_legacy_load_and_names_the_weight_where_strictness_drops_it(worlds):
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["outcomes"][LEGACY_UNTIED] == _refusal(rank), (rank, r["outcomes"][LEGACY_UNTIED])
        for way, strictness in ((LOG_ALL, "log_all"), (IGNORE_ALL, "ignore_all")):
            assert r["outcomes"][way] == "ok", (rank, way, r["outcomes"])
            assert r["logged"][way]["fix"] == [_warning(rank, strictness)], (rank, way, r["logged"][way])
            assert r["kept_initial"][way] == [OUTPUT], (rank, way, r["kept_initial"])
            assert _exact(r, way), (way, r["max_delta"])


def test_where_the_release_loads_or_refuses_on_its_own_nothing_changes(worlds):
    """The legacy checkpoint loaded as saved: exact (model, optimizer, scheduler, RNG), nothing
    logged, with the fix and without; torch_dist's default strictness refuses the untied model
    itself, in both halves alike."""
    for rank, (off, on) in enumerate(zip(worlds[False], worlds[True])):
        for r in (off, on):
            assert r["outcomes"][AS_SAVED] == "ok" and r["kept_initial"][AS_SAVED] == [], (rank, r["outcomes"])
            assert r["logged"][AS_SAVED] == {"fix": [], "release": []}, r["logged"][AS_SAVED]
            compared = [k for k in r["max_delta"] if k.startswith(f"{AS_SAVED}/")]
            assert any(":exp_avg_sq" in k for k in compared) and any("/rng:" in k for k in compared), compared
            assert _exact(r, AS_SAVED), r["max_delta"]
            assert r["outcomes"][DIST_UNTIED].startswith("CheckpointException"), r["outcomes"][DIST_UNTIED]
        assert off["outcomes"][DIST_UNTIED] == on["outcomes"][DIST_UNTIED]
        # The same values wherever both loaded (the patched half refused the legacy untied load).
        assert {k: v for k, v in off["digests"].items() if not k.startswith(f"{LEGACY_UNTIED}/")} == on["digests"]


# -- the judgement itself, on stand-in results (no world) ------------------------------------------


@pytest.fixture
def judge(monkeypatch):
    pytest.importorskip("megatron.training.checkpointing")
    from mcore_ckpt_fixes.fixes.model_load_fallback.runtime import core

    def run(missing, unexpected=(), strictness="assume_ok_unexpected"):
        monkeypatch.setattr(core, "get_args", lambda: type("Args", (), {"dist_ckpt_strictness": strictness})())
        return core._dropped_model_weights(list(missing), list(unexpected))

    return run


@pytest.mark.one_line  # the helper's text, the same on every line
def test_extra_state_and_unexpected_keys_alone_load_as_the_release_does(judge, caplog):
    with caplog.at_level(logging.WARNING, logger="mcore_ckpt_fixes"):
        assert judge(["decoder.layers.0.mlp.linear_fc1._extra_state", "output_layer._extra_state"]) is None
        assert judge([], ["decoder.layers.9.mlp.linear_fc1.weight"]) is None
    assert caplog.records == []


@pytest.mark.one_line  # the helper's text, the same on every line
def test_many_missing_weights_are_counted_past_eight(judge, caplog):
    missing = [f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(11)] + ["x._extra_state"]
    with pytest.raises(RuntimeError) as refused:
        judge(missing, ["a", "b"])
    shown = sorted(missing[:11])[:8]
    assert f"the checkpoint lacks 11 of this model's weights ({shown!r} and 3 more; 2 keys" in str(refused.value)
    with caplog.at_level(logging.WARNING, logger="mcore_ckpt_fixes"):
        judge(missing, strictness="return_all")
    (record,) = caplog.records
    assert record.getMessage().endswith(f"(--dist-ckpt-strictness return_all): {shown!r} and 3 more")
