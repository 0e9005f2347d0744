"""The resume check on this release line: with the fixes, every configuration resumes bit for bit;
without them, exactly the configurations whose fixes this release needs diverge, where the bug is.

Each configuration is checked once per line (module-scoped): run A (uninterrupted), then B (train
and save) and C (new processes: load and continue) with the fixes at their defaults and with every
fix off. What the CPU stand-ins are and why: mcore_ckpt_fixes/resume/job.py (torch's default
generator plays the CUDA generator Megatron's tracker swaps; Apex FusedAdam's interface, since
neither Apex nor Transformer Engine installs without CUDA; CUDA streams and ``device="cuda"``
allocations on the CPU).
"""

from __future__ import annotations

import pytest

from conftest import megatron_version

from mcore_ckpt_fixes.resume import check as resume
from mcore_ckpt_fixes.resume.configs import CONFIGS, KNOWN_BUG, KNOWN_FAILING

RNG_EXPERT = "rng:tracker:expert-parallel-rng"


def _needs_training():
    why = resume.not_applicable()
    if why:
        version = megatron_version()
        assert version is not None and version.release < (0, 17), f"megatron.training missing on {version}: {why}"
        pytest.skip(f"not applicable on {version}: {why}")


_CACHE: dict = {}


def _checked(cfg, modes=("on", "off")):
    if cfg.name not in _CACHE:
        resume.prepare()
        _CACHE[cfg.name] = resume.check(cfg, modes=modes)
    return _CACHE[cfg.name]


def _fail_text(mode_out):
    if mode_out["verdict"] == "error":
        return f"{mode_out['error']}\n{mode_out.get('detail') or ''}"
    return "\n".join(
        f"rank {r['rank']} (ep {r['ep']}, tp {r['tp']}): losses differ at {r['losses_differ']}, "
        f"{r['n_differ']} values: {r['differ']}"
        for r in mode_out["ranks"]
        if not r["exact"]
    )


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_exact_with_the_fixes(cfg):
    _needs_training()
    out = _checked(cfg)["on"]
    assert out["verdict"] == "exact", _fail_text(out)
    assert len(out["ranks"]) == cfg.world
    for r in out["ranks"]:
        assert r["steps"] == list(range(resume.RESUME_AT + 1, resume.STEPS + 1))  # every resumed step compared
        assert r["n_compared"] > 100  # parameters, optimizer state, scheduler, RNG streams, losses
        # A checkpoint the fixed release wrote itself loads without a word from the fixes.
        assert not [w for w in r["load_warnings"] if "MegatronPatchWarning" in w], r["load_warnings"]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_without_the_fixes_diverges_exactly_where_a_needed_fix_is(cfg):
    _needs_training()
    out = _checked(cfg)
    off = out["off"]
    if "torch-adam-step" in out["needed_here"]:
        _fails_on_the_fresh_optimizer(off)
        return
    assert off["verdict"] != "error", _fail_text(off)
    if not out["needed_here"]:
        assert off["verdict"] == "exact", _fail_text(off)
        return
    assert out["needed_here"] == ["rng-under-ep"], out["needed_here"]
    # rng-under-ep: every EP rank > 0 resumes on EP rank 0's RNG streams. Its first resumed step
    # already differs (dropout and router noise drawn from the wrong stream) and its expert-parallel
    # stream ends elsewhere; an EP-rank-0 rank resumes its own state, so its first resumed step is
    # exact (later ones may differ: gradients are reduced across the EP ranks).
    first = resume.RESUME_AT + 1
    assert off["verdict"] == "inexact"
    for r in off["ranks"]:
        if r["ep"] > 0:
            assert r["first_step"] == first, _fail_text(off)
            assert RNG_EXPERT in r["differ_all"], r["differ_all"]
        else:
            assert r["first_step"] != first, _fail_text(off)


def _fails_on_the_fresh_optimizer(off):
    """torch's Adam (Megatron's fallback without Apex or Transformer Engine) with every fix off:
    load_checkpoint into the freshly built optimizer of the resumed run stops in
    DistributedOptimizer.state_dict's ``assert len(steps) == 1`` (no parameter has a step before
    the first one): torch-adam-step's defect (a), catalogued as ``torch-adam-fresh-load``."""
    assert off["verdict"] == "error", _fail_text(off)
    assert off["error"].startswith("resume run: rank 0: AssertionError"), off["error"]
    frames = [line for line in off["detail"].splitlines() if line.strip().startswith("File ")]
    assert "distrib_optimizer.py" in frames[-1] and frames[-1].endswith("in state_dict"), frames[-3:]
    assert any("load_checkpoint" in f for f in frames), frames


def test_no_configuration_is_known_to_fail():
    """A configuration that cannot resume for a catalogued, unfixed reason is listed apart
    (KNOWN_FAILING, reported by ``selftest --resume`` beside its verdict); none is at present."""
    assert KNOWN_FAILING == () and KNOWN_BUG == {}


def test_the_rng_stand_in_really_swaps_what_dropout_draws():
    """Inside ``tracker.fork(name)`` CPU ops must draw from that stream, after it from where they
    were, and the CPU generator must not move: a bookkeeping-only fork (draws always from one
    generator) would make every stream look restored while nothing is drawn from it."""
    _needs_training()
    import torch

    from mcore_ckpt_fixes.testing.launcher import run_world, values

    if torch.cuda.is_available():
        pytest.skip("the stand-in is used only without CUDA")
    (got,) = values(run_world("mcore_ckpt_fixes.resume.rng_standin:fork_draws", 1, timeout=120))
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


def test_selftest_resume_bad_nproc_is_one_line_exit_2():
    """No configuration for that world size: one clear line, exit 2, nothing run (where the check runs)."""
    _needs_training()
    from conftest import run_cli

    proc = run_cli(["selftest", "--resume", "--nproc", "3"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "mcore-ckpt-fixes selftest --resume: no configuration runs on 3 ranks"
    assert proc.stdout == ""
