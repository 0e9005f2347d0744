"""The resume check on a user's own job: its shrunk arguments (:mod:`.own_shrink`) trained,
saved, stopped and resumed, bit for bit against the release's own uninterrupted run.

Runs, each a world of ``plan.world`` ranks: A, the release alone (every fix off), 6 steps; B, with
the fixes, saving at step 3 and training on; C, new processes loading B's checkpoint and training
to step 6; then B and C again with every fix off. The verdicts, per rank:
*unchanged* (B = A: the fixes change nothing in a run that never resumes), *exact* (C = A), and
what the fixes change (C without them against A). With attribution, the fixes whose absence
explains an inexact resume without them are found by halving the applied fixes (B and C with
only a half on) until the smallest set that is exact on its own is left.

The same runs can be started by the user's own launcher (``--print-launch``: one world per run,
:mod:`.own_rank`); each rank then writes its result into a results directory, and :func:`judge`
compares what is there.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import shutil
import tempfile

from ..testing.job_config import Config
from .own_shrink import SAVE_AT, STEPS

OFF, AUTO = {"MCORE_CKPT_FIXES": "off"}, {"MCORE_CKPT_FIXES": "auto"}
# (phase, mode) of each run, in the order they run.
RUN_A, RUN_B, RUN_C = ("uninterrupted", "off"), ("save", "on"), ("resume", "on")
RUN_B_OFF, RUN_C_OFF = ("save", "off"), ("resume", "off")


def config_for(plan, name="your-job") -> Config:
    """The job as the resume machinery runs it: its layout from the shrunk, validated arguments."""
    a = plan.args
    vpp = getattr(a, "virtual_pipeline_model_parallel_size", None) or 0
    experts = bool(getattr(a, "num_experts", None))
    # Options with which a resume is not meant to equal the uninterrupted run: held to the release's
    # own resume instead (the same bits with the fixes as without them).
    as_release = bool(getattr(a, "no_load_optim", False) or getattr(a, "no_load_rng", False))
    return Config(
        name,
        "your job, shrunk",
        expect="as-release" if as_release else "exact",
        world=plan.world,
        tp=a.tensor_model_parallel_size,
        pp=a.pipeline_model_parallel_size,
        vpp=vpp,
        ep=a.expert_model_parallel_size if experts else 0,
        etp=(a.expert_tensor_parallel_size or 0) if experts else 0,
        distributed_optimizer=a.use_distributed_optimizer,
        ckpt_format=a.ckpt_format,
        megatron_argv=tuple(plan.argv),
    )


def run_local(cfg, device="cpu", attribution=False, timeout=300.0, progress=print) -> dict:
    """Every run on this host (forked worlds); the report of :func:`judge`."""
    from .check import run_phase

    results, ckpt_root = {}, tempfile.mkdtemp(prefix="mcore-ckpt-fixes-own-job-")
    try:

        def world(run, env, ckpt):
            progress(f"run {_label(run)} ...")
            values, error, detail = run_phase(cfg, run[0], ckpt, env, device, timeout, steps=STEPS, resume_at=SAVE_AT)
            results[run] = values if values is not None else {"error": error, "detail": detail}
            progress(" failed" if error else " done", "\n")
            return error is None

        def pair(env, b, c, ckpt):
            os.makedirs(ckpt, exist_ok=True)
            return world(b, env, ckpt) and world(c, env, ckpt)

        if world(RUN_A, OFF, os.path.join(ckpt_root, "none")):
            pair(AUTO, RUN_B, RUN_C, os.path.join(ckpt_root, "on"))
            # Always: what the fixes change is C without them against A.
            pair(OFF, RUN_B_OFF, RUN_C_OFF, os.path.join(ckpt_root, "off"))
        report = judge(results, cfg.expect)
        if attribution and report.get("fixes_change") == "exact only with the fixes":
            report["explained_by"] = _attribute(cfg, device, timeout, results[RUN_A], progress, ckpt_root)
        return report
    finally:
        shutil.rmtree(ckpt_root, ignore_errors=True)


def _label(run) -> str:
    names = {RUN_A: "A (uninterrupted, fixes off)", RUN_B: "B (save at 3, fixes on)", RUN_C: "C (resume, fixes on)"}
    names.update({RUN_B_OFF: "B (save at 3, fixes off)", RUN_C_OFF: "C (resume, fixes off)"})
    return names[run]


def _attribute(cfg, device, timeout, uninterrupted, progress, ckpt_root) -> list:
    """The smallest set of the applied fixes with which the resume alone is exact (halving)."""
    import mcore_ckpt_fixes

    from .check import run_phase, verdict_against

    def exact_with(fixes) -> bool:
        env = {"MCORE_CKPT_FIXES": ",".join(fixes) or "off"}
        ckpt = tempfile.mkdtemp(dir=ckpt_root)
        progress(f"attribution: only {', '.join(fixes) or 'none'} ...")
        values = None
        for phase in ("save", "resume"):
            values, error, _ = run_phase(cfg, phase, ckpt, env, device, timeout, steps=STEPS, resume_at=SAVE_AT)
            if error:
                progress(" failed", "\n")
                return False
        ok = verdict_against(uninterrupted, values)["verdict"] == "exact"
        progress(" exact" if ok else " inexact", "\n")
        return ok

    needed = [row["id"] for row in mcore_ckpt_fixes.report() if row["state"] == "applied"]
    while len(needed) > 1:
        half = len(needed) // 2
        if exact_with(needed[:half]):
            needed = needed[:half]
        elif exact_with(needed[half:]):
            needed = needed[half:]
        else:
            break  # fixes from both halves are needed: the set is named as it stands
    return needed


def judge(results, expect="exact") -> dict:
    """The verdicts from the runs' per-rank results (``{(phase, mode): [rank values] | {"error"}}``).
    ``expect="as-release"`` (the job does not load its optimizer or RNG state): run C with the fixes
    is held to run C without them, the release's own resume."""
    from .check import verdict_against
    from .compare import release_rank_verdict

    a = results.get(RUN_A)
    if not isinstance(a, list):
        a = a or {"error": "run A did not run"}
        return {"verdict": "error", "error": a["error"], "detail": a.get("detail"), "unchanged": {}}
    report = {}
    for key, run in (("unchanged", RUN_B), ("exact", RUN_C), ("unchanged_off", RUN_B_OFF), ("exact_off", RUN_C_OFF)):
        got = results.get(run)
        if isinstance(got, list):
            report[key] = verdict_against(a, got)
        elif got is not None:
            report[key] = {"verdict": "error", "error": got["error"], "detail": got.get("detail")}
    c_on, c_off = results.get(RUN_C), results.get(RUN_C_OFF)
    if expect == "as-release" and isinstance(c_on, list) and isinstance(c_off, list):
        ranks = [release_rank_verdict(r, f) for r, f in zip(c_off, c_on)]
        report["as_release"] = {
            "verdict": "as-release" if all(r["exact"] for r in ranks) else "differs",
            "ranks": ranks,
        }
    report["expect"] = expect
    judged = report.get("as_release" if expect == "as-release" else "exact")
    missing = {"verdict": "error", "error": "run C (resume, fixes on) has no results"}
    if judged is None:
        report["as_release" if expect == "as-release" else "exact"] = judged = missing
    report["verdict"] = judged["verdict"]
    report.setdefault("unchanged", {"verdict": "error", "error": "run B (save, fixes on) has no results"})
    report["fixes_change"] = _fixes_change(report)
    return report


def _fixes_change(report) -> str:
    if report.get("expect") == "as-release":
        same = report.get("as_release", {}).get("verdict") == "as-release"
        return (
            "nothing: the job does not load its optimizer or RNG state (--no-load-optim / --no-load-rng), so "
            "its resume is not meant to equal the uninterrupted run; "
            + (
                "with the fixes it is the release's own resume, bit for bit"
                if same
                else "with the fixes it differs from the release's own resume"
            )
        )
    on, off = report.get("exact", {}).get("verdict"), report.get("exact_off", {}).get("verdict")
    if off is None:
        return "nothing (the fixes' run was exact; the release's own not run)" if on == "exact" else "unknown"
    if on == "exact" and off != "exact":
        return "exact only with the fixes"
    if on == "exact":
        return "nothing: exact with and without them"
    if off == on:
        return "nothing: the release itself does not resume this job exactly (a bug to report)"
    return "the fixes change the outcome, and it is not exact with them"


def first_difference(verdict) -> str:
    """The first differing quantity of a verdict: the loss at a step, else the first state entry
    (parameters, then optimizer state, scheduler, RNG streams), on the first rank that differs."""
    if verdict.get("verdict") == "error":
        return verdict.get("error", "error")
    bad = [r for r in verdict.get("ranks", []) if not r["exact"]]
    if not bad:
        return ""
    first = min(bad, key=lambda r: (r["first_step"] is None, r["first_step"] or 0, r["rank"]))
    loss = f"the loss at step {first['first_step']} on rank {first['rank']}" if first["first_step"] is not None else ""
    if not first["differ_all"]:
        return loss
    order = ("rng:", "param:", "optim", "scheduler:")  # an RNG stream explains the rest where it differs
    name = min(first["differ_all"], key=lambda n: next((i for i, p in enumerate(order) if n.startswith(p)), 9))
    state = f"{name} ({first['n_differ']} final state entries differ on rank {first['rank']})"
    return f"{loss}; {state}" if loss else state


# -- the runs started by the user's own launcher ------------------------------------------------------


def write_plan(directory, plan, cfg) -> str:
    """The shrunk job, for :mod:`.own_rank` on every node: ``plan.json`` in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "plan.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"argv": list(cfg.megatron_argv), "world": cfg.world, "config": _fields(cfg)}, f, indent=1)
    return path


def _fields(cfg) -> dict:
    keep = (
        "name",
        "summary",
        "world",
        "tp",
        "pp",
        "vpp",
        "ep",
        "etp",
        "distributed_optimizer",
        "ckpt_format",
        "expect",
    )
    return {k: getattr(cfg, k) for k in keep}


def read_plan(path) -> Config:
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    return Config(**saved["config"], megatron_argv=tuple(saved["argv"]))


def result_path(directory, run, rank) -> str:
    return os.path.join(directory, "results", f"{run[0]}-{run[1]}", f"rank{rank}.pkl")


def read_results(directory, world) -> dict:
    """What the ranks of each run wrote (:func:`result_path`); a run with a rank missing is an error."""
    results = {}
    for run in (RUN_A, RUN_B, RUN_C, RUN_B_OFF, RUN_C_OFF):
        paths = [result_path(directory, run, r) for r in range(world)]
        there = [p for p in paths if os.path.exists(p)]
        if not there:
            continue
        if len(there) < world:
            missing = sorted(set(paths) - set(there))
            results[run] = {"error": f"{len(missing)} of {world} ranks wrote no result (e.g. {missing[0]})"}
            continue
        values = []
        for p in paths:
            with open(p, "rb") as f:  # written by this package's own ranks (own_rank.py) for this check
                values.append(pickle.load(f))
        results[run] = values
    return results


def results_present(directory) -> list:
    return sorted(glob.glob(os.path.join(directory, "results", "*", "rank*.pkl")))
