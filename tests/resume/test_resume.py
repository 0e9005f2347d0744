"""The resume check on this release line: with the fixes, every configuration resumes bit for bit;
without them, exactly the configurations whose fixes this release needs diverge, where the bug is.
Options whose resume is not meant to be exact (``expect="as-release"``): with the fixes, the resumed
run is the release's own resumed run bit for bit, or fails with the same error.

Each configuration is checked once per line (module-scoped): run A (the release's own uninterrupted
run, every fix off), then B (train, save and go on) and C (new processes: load and continue) with the
fixes at their defaults and with every fix off. B with the fixes on never resumes: it must be A, bit
for bit, over every step (the import changes nothing where the release works). What the CPU stand-ins are and why: mcore_ckpt_fixes/testing/gpt_job.py (torch's default
generator plays the CUDA generator Megatron's tracker swaps; Apex FusedAdam's interface, since
neither Apex nor Transformer Engine installs without CUDA; CUDA streams and ``device="cuda"``
allocations on the CPU).
"""

from __future__ import annotations

import pytest
import resume_expect as expect
from conftest import megatron_version, needs_megatron_training, on_this_line, resume_fail_text

from mcore_ckpt_fixes.resume import check as resume
from mcore_ckpt_fixes.resume.configs import CONFIGS, KNOWN_BUG, KNOWN_FAILING, by_name
from mcore_ckpt_fixes.testing.job_config import Config

MIMO = by_name("mimo-noncolocated")
# The layouts of Megatron's pipeline schedule and expert TP (docs/resume.md): every one on the
# newest line, these on the older lines named (CI's time: each costs a world of up to 8 ranks five
# times). The interleaved schedule on both, as they differ (0.17 frees a pipeline output before its
# send completes, 0.18 waits); the strict load of a validate-results job on 0.18, where its fix is
# needed (0.17 writes no rerun entry there without rerun-state-constant-structure).
LAYOUTS_ON_OLDER_LINES = {
    "gpt-pp2": ((0, 17),),
    "gpt-pp2-vpp2": ((0, 17), (0, 18)),
    "moe-pp2-ep2": ((0, 17),),
    "gpt-pp2-dp2-tied-padding": ((0, 17),),
    "gpt-pp2-strict-validate-results": ((0, 18),),
}


def _on_this_line(cfg) -> bool:
    if cfg.pp == 1 and cfg.etp <= 1 and cfg.world <= 4:
        return True
    return on_this_line(cfg.name, LAYOUTS_ON_OLDER_LINES)


LINE = [c for c in CONFIGS if _on_this_line(c)]
# Held to the uninterrupted run (exact), or to the release's own resume (as-release).
EXACT = [c for c in LINE if c.expect == "exact"]
AS_RELEASE = [c for c in LINE if c.expect == resume.AS_RELEASE]


# Attribution, on one configuration and one line (one more save and resume: the same code runs
# every configuration's "only" mode): with only the fixes it declares (MCORE_CKPT_FIXES=
# mimo-optimizer, every other fix off), the MIMO configuration resumes exactly on 0.18, where with
# every fix off it cannot even save.
ATTRIBUTED = (MIMO.name, (0, 18))


def _attributed_here(cfg):
    version = megatron_version()
    return cfg.name == ATTRIBUTED[0] and version is not None and version.release[:2] == ATTRIBUTED[1]


_CACHE: dict = {}


def _checked(cfg, modes=None):
    modes = modes or (("on", "off", resume.ONLY) if _attributed_here(cfg) else ("on", "off"))
    if cfg.name not in _CACHE:
        resume.prepare()
        _CACHE[cfg.name] = resume.check(cfg, modes=modes)
    out = _CACHE[cfg.name]
    if "not_applicable" in out:
        # Only a release without MimoOptimizer (0.16 has no megatron.core.models.mimo) may lack it.
        assert cfg.requires and resume.missing_requirement(cfg), out
        pytest.skip(f"{cfg.name} not applicable here: {out['not_applicable']}")
    return out


@pytest.mark.parametrize("cfg", EXACT, ids=[c.name for c in EXACT])
def test_exact_with_the_fixes(cfg):
    needs_megatron_training()
    expect.assert_exact_with_the_fixes(cfg, _checked(cfg))


@pytest.mark.parametrize("cfg", LINE, ids=[c.name for c in LINE])
def test_a_run_that_never_resumes_is_unchanged_by_the_fixes(cfg):
    """B with every fix at its default against the release's own run A: the same bits (resume_expect)."""
    needs_megatron_training()
    expect.assert_unchanged_by_the_fixes(cfg, _checked(cfg))
    if cfg.job in (Config.job, "mcore_ckpt_fixes.resume.mimo:run"):  # they record which Adam ran (no Apex or TE here)
        assert _checked(cfg)["optimizer"] == ("FusedAdam stand-in" if cfg.fused_adam else "torch AdamW"), cfg


@pytest.mark.parametrize("cfg", EXACT, ids=[c.name for c in EXACT])
def test_without_the_fixes_diverges_exactly_where_a_needed_fix_is(cfg):
    needs_megatron_training()
    expect.assert_without_the_fixes(cfg, _checked(cfg))


PIPELINED = [c for c in EXACT if c.pp > 1]


@pytest.mark.parametrize("cfg", PIPELINED, ids=[c.name for c in PIPELINED])
def test_a_pipeline_configuration_trains_on_every_stage_and_chunk(cfg):
    """The resumed run really is a pipeline: its ranks sit on every stage, and under interleaving
    every rank holds and compares each of its model chunks."""
    needs_megatron_training()
    ranks = _checked(cfg)["on"]["ranks"]
    assert sorted({r["pp"] for r in ranks}) == list(range(cfg.pp)), ranks
    for r in ranks:
        chunks = {n.split(".", 1)[0] for n in r["compared_all"] if n.startswith("param:chunk")}
        assert chunks == {f"param:chunk{i}" for i in range(cfg.vpp)}, (r["rank"], sorted(chunks))


# -- options whose resume is not meant to equal the uninterrupted run ---------------------------------


@pytest.mark.parametrize("cfg", AS_RELEASE, ids=[c.name for c in AS_RELEASE])
def test_resumes_as_the_release_with_the_fixes(cfg):
    needs_megatron_training()
    expect.assert_as_release_with_the_fixes(cfg, _checked(cfg))


@pytest.mark.parametrize("cfg", AS_RELEASE, ids=[c.name for c in AS_RELEASE])
def test_the_release_resumes_as_each_option_says(cfg):
    needs_megatron_training()
    expect.assert_release_resumes_as_each_option_says(cfg, _checked(cfg))


def _rank(losses, state, iteration=2, rank=0):
    return {
        "coords": {"rank": rank, "tp": 0, "ep": 0, "dp": rank},
        "losses": losses,
        "state": state,
        "iteration": iteration,
    }


@pytest.mark.one_line
def test_the_comparison_with_the_release_sees_any_difference():
    """The as-release verdict can fail: the same results compare as the release's, and each of these
    changes is caught and named: one bit of one tensor on one rank, one loss one float apart, the
    iteration load_checkpoint returned, an error only one side raised, two different errors. Two
    errors that differ only in the checkpoint directory each mode saved to are the same error.

    Also tried on the configuration's real runs (0.19.2): with the resumed job drawing one more
    NumPy number when the fixes are on (a deliberate change to gpt_job.py, not kept), every way of
    dense-dp2-resume-options that resumes became ``differs`` from step 3 on both ranks, and the
    test above failed."""
    import dataclasses
    import math

    import torch

    cfg = dataclasses.replace(by_name("dense-dp2-resume-options"), resume_args=())

    def ranks(bit=False, loss=1.5, iteration=2):
        w = torch.arange(6, dtype=torch.float32)
        if bit:
            w.view(torch.int32)[3] ^= 1
        return [
            _rank({3: 1.5, 4: 1.25}, {"param:w": torch.zeros(3)}),
            _rank({3: 1.5, 4: loss}, {"param:w": w}, iteration, 1),
        ]

    def verdict(fixed, release):
        return resume.same_as_release(cfg, fixed, release)

    assert verdict(ranks(), ranks())["verdict"] == "as-release"
    flipped = verdict(ranks(bit=True), ranks())
    assert flipped["verdict"] == "differs" and [r["differ"] for r in flipped["ranks"]] == [[], ["param:w"]], flipped
    ulp = verdict(ranks(loss=math.nextafter(1.25, 2.0)), ranks())
    assert ulp["verdict"] == "differs" and ulp["ranks"][1]["first_step"] == 4, ulp
    loaded = verdict(ranks(iteration=0), ranks())
    assert loaded["verdict"] == "differs" and loaded["ranks"][1]["differ"] == ["load:iteration"], loaded

    def failed(text):
        return [{"coords": {"rank": r}, "error": text, "detail": "..."} for r in range(2)]

    where = resume.ckpt_prefix(cfg, "on") + "abc123/iter_0000002"
    there = resume.ckpt_prefix(cfg, "off") + "xyz789/iter_0000002"
    assert verdict(failed(f"OSError: {where}"), failed(f"OSError: {there}"))["same"] == "error"
    assert verdict(failed("KeyError: 1"), failed("KeyError: 2"))["verdict"] == "differs"
    assert verdict(failed("KeyError: 1"), ranks())["verdict"] == "differs"
    assert (
        verdict(ranks(), failed("KeyError: 1"))["error"]
        == "resumed, where the release failed (resume run: rank 0: KeyError: 1)"
    )


@pytest.mark.one_line
def test_resuming_several_ways_in_one_world_does_not_depend_on_the_order():
    """Run C resumes one checkpoint several ways in the same processes, each from a newly built and
    seeded job: in the reverse order every way gives the same bits (or error) as in the configured
    order, so no way inherits what one before it left behind (and the first way of each order runs
    in processes that did nothing before it)."""
    import dataclasses
    import shutil
    import tempfile

    needs_megatron_training()
    resume.prepare()
    cfg = AS_RELEASE[0]
    backwards = dataclasses.replace(cfg, resume_args=tuple(reversed(cfg.resume_args)))
    ckpt_dir = tempfile.mkdtemp(prefix=resume.ckpt_prefix(cfg, "off"))
    try:
        runs = [resume.run_phase(cfg, "save", ckpt_dir, resume.MODES["off"], "cpu", 240.0)]
        runs += [resume.run_phase(c, "resume", ckpt_dir, resume.MODES["off"], "cpu", 240.0) for c in (cfg, backwards)]
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    assert [error for _, error, _ in runs] == [None] * 3, runs
    forwards, reverse = resume.per_way(runs[1][0]), resume.per_way(runs[2][0])[::-1]
    for args, fwd, rev in zip(cfg.resume_args, forwards, reverse):
        way = resume.same_as_release(cfg, fwd, rev)
        assert way["verdict"] == resume.AS_RELEASE, (
            args,
            way.get("error"),
            [r["differ"] for r in way.get("ranks", [])],
        )


def test_only_the_needed_fixes_resume_exactly():
    """The fixes a configuration declares are all it needs: with only those on, exact on every rank."""
    needs_megatron_training()
    if not _attributed_here(MIMO):
        pytest.skip(f"attribution runs for {ATTRIBUTED[0]} on {'.'.join(map(str, ATTRIBUTED[1]))} only (test time)")
    out = _checked(MIMO)
    assert out["needed_here"] == ["mimo-optimizer"], out["needed_here"]  # without it, no save (above)
    assert resume.mode_env(MIMO, resume.ONLY) == {"MCORE_CKPT_FIXES": "mimo-optimizer"}
    only = out[resume.ONLY]
    assert only["verdict"] == "exact", resume_fail_text(only)
    assert len(only["ranks"]) == MIMO.world
    assert [r["n_compared"] for r in only["ranks"]] == [r["n_compared"] for r in out["on"]["ranks"]]


def test_mimo_ranks_train_their_own_module():
    """The MIMO configuration's ranks: language model on 0, vision encoder on 1, each compared on its
    parameters, its distributed optimizer's fp32 shards and moments, the scheduler and every stream."""
    needs_megatron_training()
    out = _checked(MIMO)["on"]
    assert [r["module"] for r in out["ranks"]] == ["language", "vision"], out["ranks"]
    for r in out["ranks"]:
        _assert_mimo_compares_everything(set(r["compared_all"]))


def _assert_mimo_compares_everything(names):
    for part in ("param:fc1.weight", "optim0:group0:main0", "state0:exp_avg_sq", "scheduler:num_steps", "rng:cuda"):
        assert any(part in n for n in names), (part, sorted(names))
    assert {"rng:python", "rng:numpy", "rng:torch", "rng:tracker:model-parallel-rng"} <= names, sorted(names)


def test_mimo_not_applicable_without_mimo_optimizer():
    """A release without MimoOptimizer reports the configuration as not applicable, with the reason;
    it is never run or counted as exact. Shown with a module this release lacks in MimoOptimizer's
    place (on 0.16, which has neither, the whole check is not applicable: test below)."""
    import dataclasses

    needs_megatron_training()
    assert not resume.missing_requirement(MIMO)  # megatron.core.models.mimo ships with megatron.training
    cfg = dataclasses.replace(MIMO, requires="megatron.core.models.mimo.no_such_optimizer")
    out = resume.check(cfg)
    assert out["not_applicable"].startswith("megatron.core.models.mimo.no_such_optimizer does not import"), out
    assert "on" not in out and "off" not in out, out


FRAMEWORK_CONFIGS = {
    "moe-ep2-bridge": "test_bridge_resume.py",
    "moe-ep2-verl": "test_verl_resume.py",
    "moe-ep2-ms-swift": "test_ms_swift_resume.py",
}


@pytest.mark.parametrize("name", sorted(FRAMEWORK_CONFIGS))
def test_framework_configuration_not_applicable_without_the_framework(name):
    """Where the framework is not installed (every release line), its configuration says so with the
    reason instead of running; tests/frameworks runs it in the framework's own line."""
    needs_megatron_training()
    cfg = by_name(name)
    if not resume.missing_requirement(cfg):
        pytest.skip(f"{cfg.requires} imports here: tests/frameworks/{FRAMEWORK_CONFIGS[name]} runs {name}")
    out = resume.check(cfg)
    assert out["not_applicable"].startswith(f"{cfg.requires} does not import here"), out
    assert "on" not in out and "off" not in out, out


def test_no_configuration_is_known_to_fail():
    """A configuration that cannot resume for a catalogued, unfixed reason is listed apart
    (KNOWN_FAILING, reported by ``selftest --resume`` beside its verdict); none is at present."""
    assert KNOWN_FAILING == () and KNOWN_BUG == {}


def test_the_rng_stand_in_really_swaps_what_dropout_draws():
    """Inside ``tracker.fork(name)`` CPU ops must draw from that stream, after it from where they
    were, and the CPU generator must not move: a bookkeeping-only fork (draws always from one
    generator) would make every stream look restored while nothing is drawn from it."""
    needs_megatron_training()
    import torch

    from mcore_ckpt_fixes.testing.launcher import run_world, values

    if torch.cuda.is_available():
        pytest.skip("the stand-in is used only without CUDA")
    (got,) = values(run_world("mcore_ckpt_fixes.testing._rng_standin:fork_draws", 1, timeout=120))
    stream, outer = torch.Generator().manual_seed(2), torch.Generator().manual_seed(1)
    assert torch.equal(got["inside"], torch.rand(8, generator=stream))  # drawn from the tracker's stream
    assert torch.equal(got["after"], torch.rand(8, generator=outer))  # the default stream, untouched by the fork
    assert torch.equal(got["cpu_before"], got["cpu_after"])  # the CPU generator is a stream of its own
    assert (got["dropped"] == 0).any() and (got["dropped"] != 0).any()  # dropout drew there too


def test_not_applicable_without_megatron_training():
    """0.16.x wheels ship no megatron.training: the check says so instead of passing."""
    if not resume.not_applicable():
        pytest.skip("megatron.training imports on this line (the check runs: tests above)")
    from conftest import run_cli

    proc = run_cli(["selftest", "--resume"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not applicable here: megatron.training does not import" in proc.stderr


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--nproc", "1"], "no configuration runs on 1 rank or fewer"),
        (
            ["--config", "gpt-pp2,no-such"],
            "unknown configuration 'no-such'; accepted: " + ", ".join(c.name for c in CONFIGS),
        ),
        (["--config", "gpt-tp2-pp2-dp2", "--nproc", "4"], "--nproc 4 is too few for gpt-tp2-pp2-dp2 (8 ranks)"),
    ],
    ids=["no-config-that-small", "unknown-config", "config-needs-more-ranks"],
)
def test_selftest_resume_bad_choice_is_one_line_exit_2(argv, line):
    """No configuration for that world size, an unknown name, or a named one that needs more ranks
    than --nproc gives: one clear line, exit 2, nothing run (where the check runs)."""
    needs_megatron_training()
    from conftest import run_cli

    proc = run_cli(["selftest", "--resume", *argv])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == f"mcore-ckpt-fixes selftest --resume: {line}"
    assert proc.stdout == ""


def test_the_default_resume_check_runs_the_two_rank_configurations_and_nproc_8_every_one():
    assert resume.chosen() == [c for c in CONFIGS if c.world <= 2]
    assert resume.chosen(nproc=8) == list(CONFIGS)
    assert [c.name for c in resume.chosen(["moe-pp2-ep2", "gpt-pp2"])] == ["gpt-pp2", "moe-pp2-ep2"]


def test_config_without_resume_is_one_line_exit_2():
    from conftest import run_cli

    proc = run_cli(["selftest", "--config", "gpt-pp2"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "mcore-ckpt-fixes selftest: --config goes with --resume"


def test_attribution_without_resume_is_one_line_exit_2():
    """``--attribution`` belongs to the resume check: alone it says so and runs nothing."""
    from conftest import run_cli

    proc = run_cli(["selftest", "--attribution"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "mcore-ckpt-fixes selftest: --attribution goes with --resume"
    assert proc.stdout == ""
