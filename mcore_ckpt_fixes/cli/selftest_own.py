"""``selftest --resume --megatron-args "..."`` / ``--megatron-args-file FILE``: the resume check on
the user's own job (:mod:`mcore_ckpt_fixes.resume.own_job`).

The job's arguments are read (:mod:`~mcore_ckpt_fixes.resume.own_args`), parsed and validated by
the installed release, shrunk (:mod:`~mcore_ckpt_fixes.resume.own_shrink`; the changes are printed
as before -> after), then trained, saved, stopped and resumed on this host; or, with
``--print-launch DIR``, written to ``DIR`` with the commands that run each phase under the user's
own launcher, and judged later with ``--compare DIR``. Exit 0 only when the job resumes exactly with
the fixes (or, for a job that does not load its optimizer or RNG state, as the release resumes it)
and the fixes change nothing in the run that never resumes; 1 otherwise; 2 for bad input, an
argument that cannot be kept here without ``--allow-drop``, or a world that cannot run.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from mcore_ckpt_fixes.engine.version import detect

from .selftest_run import captured, progress, set_aside_user_flags, stack

NAME = "mcore-ckpt-fixes selftest --resume"


def _refuse(message) -> int:
    print(f"{NAME}: {message}", file=sys.stderr)
    return 2


def read_job(megatron_args, args_file):
    """The job's arguments (the file's, then the command line's) and what the file launches."""
    from mcore_ckpt_fixes.resume import own_args

    argv, script = [], None
    if args_file:
        argv, script = own_args.from_file(args_file)
    if megatron_args:
        argv += own_args.from_text(megatron_args)
    if script and not script.startswith("pretrain_gpt"):
        raise ValueError(f"the file launches {script}: the check trains GPT jobs (pretrain_gpt.py)")
    if not argv:
        raise ValueError("no Megatron arguments found (give --megatron-args or a file that has them)")
    return argv, script


def run(
    megatron_args=None,
    args_file=None,
    device="cpu",
    nproc=None,
    as_json=False,
    allow_drop=False,
    attribution=False,
    print_launch=None,
    compare=None,
) -> int:
    from mcore_ckpt_fixes.resume import check, own_job, own_shrink

    info = detect()
    if info.source == "absent":
        return _refuse("Megatron-Core is not importable in this environment")
    with contextlib.redirect_stdout(sys.stderr):  # megatron.training's first import logs to stdout
        why = check.not_applicable()
    if why:
        return _refuse(f"not applicable here: {why}")
    if compare:
        return _compare(compare, as_json)
    try:
        argv, _ = read_job(megatron_args, args_file)
        with contextlib.redirect_stdout(sys.stderr):
            # Launched on the user's own cluster (--device cuda: its GPUs, the job's kernels kept):
            # no host limit on the layout.
            host = dict(device=device, host_ranks=10**9) if print_launch else dict(device=device)
            plan = own_shrink.plan(argv, nproc=nproc, **host)
    except ValueError as exc:
        return _refuse(str(exc))
    dropped = plan.dropped()
    if dropped and not allow_drop:
        named = "; ".join(f"{c.option} ({c.why})" for c in dropped)
        return _refuse(f"cannot keep on this host: {named}; --allow-drop runs the check without them")
    cfg = own_job.config_for(plan)
    if print_launch:
        return _print_launch(print_launch, plan, cfg)
    torch_version, stack_skip = stack(device, None)
    if torch_version is None:
        return _refuse(stack_skip)
    if not as_json:
        _print_changes(plan, info, torch_version, device)
    set_aside = set_aside_user_flags()
    if set_aside:
        progress(
            f"{NAME}: ignoring {', '.join(f'{k}={v}' for k, v in set_aside.items())}: the fixes run at their defaults and off",
            "\n",
        )
    report = _run_here(cfg, device, attribution)
    return _finish(report, plan, cfg, as_json)


def _run_here(cfg, device, attribution) -> dict:
    import tempfile

    import mcore_ckpt_fixes
    from mcore_ckpt_fixes.resume import check, own_job

    fd, log_path = tempfile.mkstemp(prefix="mcore-ckpt-fixes-own-job-", suffix=".log")
    os.close(fd)
    began = time.monotonic()
    with captured(log_path):
        mcore_ckpt_fixes.revert()
        mcore_ckpt_fixes.apply()
        check.prepare_core()
        report = own_job.run_local(cfg, device, attribution=attribution, progress=progress)
        report["applied"] = [row["id"] for row in mcore_ckpt_fixes.report() if row["state"] == "applied"]
    report["seconds"] = round(time.monotonic() - began, 1)
    report["log"] = log_path
    return report


def passed(report) -> bool:
    return report["verdict"] in ("exact", "as-release") and report["unchanged"].get("verdict") == "exact"


def _finish(report, plan, cfg, as_json) -> int:
    code = 0 if passed(report) else 1
    if code == 0 and "log" in report:
        os.unlink(report.pop("log"))
    elif "log" in report:
        progress(f"{NAME}: what the ranks and Megatron printed is in {report['log']}", "\n")
    if as_json:
        print(json.dumps(_json(report, plan, cfg), indent=2, default=str))
    else:
        _print_verdicts(report, code)
    return code


def _json(report, plan, cfg) -> dict:
    for key in ("unchanged", "exact", "unchanged_off", "exact_off", "as_release"):
        for r in report.get(key, {}).get("ranks", []):
            r.pop("differ_all", None)
            r.pop("compared_all", None)
    out = {"world": cfg.world, "argv": list(cfg.megatron_argv), "report": report}
    if plan is not None:
        out["changes"] = [vars(c) for c in plan.changes]
    return out


def _print_changes(plan, info, torch_version, device) -> None:
    print(
        f"your job on Megatron-Core {info.version} ({info.source}), torch {torch_version}, {device}: "
        f"{plan.world} ranks, 6 steps, saved after 3 and resumed in new processes"
    )
    for kind, title in (("shrunk", "shrunk"), ("host", "on this host"), ("dropped", "dropped (--allow-drop)")):
        changes = [c for c in plan.changes if c.kind == kind]
        if changes:
            print(f"  {title}:")
            for c in changes:
                print(f"    {c.option}: {c.before} -> {c.after}  ({c.why})")


def describe(verdict) -> str:
    from mcore_ckpt_fixes.resume.own_job import first_difference

    if verdict.get("verdict") in ("exact", "as-release"):
        n = sum(r["n_compared"] for r in verdict.get("ranks", []))
        return f"{verdict['verdict']}, bit for bit ({len(verdict.get('ranks', []))} ranks, {n} values)"
    if verdict.get("verdict") == "error":
        error = verdict.get("error", "")
        return f"error: {error[:300]}{' ...' if len(error) > 300 else ''}"
    return f"{verdict.get('verdict')}: first difference {first_difference(verdict)}"


def _print_verdicts(report, code) -> None:
    if "error" in report:  # run A itself did not run
        print(f"  ERROR: {report['error']}")
    else:
        print(f"  unchanged (B = A): {describe(report['unchanged'])}")
        key = "as_release" if report.get("expect") == "as-release" else "exact"
        title = "as the release (C = C without the fixes)" if key == "as_release" else "exact (C = A)"
        print(f"  {title}: {describe(report.get(key, {'verdict': 'error', 'error': 'not run'}))}")
        if "exact_off" in report:
            print(f"  without the fixes, C = A: {describe(report['exact_off'])}")
        print(f"  what the fixes change: {report['fixes_change']}")
        if report.get("fixes_change") == "exact only with the fixes":
            named = report.get("explained_by")
            print(
                "    explained by: "
                + (
                    ", ".join(named)
                    if named
                    else f"one or more of {', '.join(report.get('applied', []))} (--attribution names which)"
                )
            )
    print(
        f"{'PASS' if code == 0 else 'FAIL'}: your job {'resumes exactly with the fixes' if code == 0 else 'does not resume exactly with the fixes'}"
    )


def _print_launch(directory, plan, cfg) -> int:
    from mcore_ckpt_fixes.resume import own_job

    path = own_job.write_plan(directory, plan, cfg)
    d = os.path.abspath(directory)
    per_node = min(cfg.world, 8)
    nodes = -(-cfg.world // per_node)
    print(f"# the shrunk job is in {path} ({cfg.world} ranks); {d} must be shared by every node")
    for kind, title in (("shrunk", "shrunk"), ("dropped", "dropped")):
        for c in [c for c in plan.changes if c.kind == kind]:
            print(f"#   {title}: {c.option}: {c.before} -> {c.after}")
    runs = (
        ("A", "uninterrupted", "off"),
        ("B", "save", "on"),
        ("C", "resume", "on"),
        ("B without the fixes", "save", "off"),
        ("C without the fixes", "resume", "off"),
    )
    print("# torchrun, on every node (NODE_RANK 0..%d, MASTER_ADDR the first node's address):" % (nodes - 1))
    for title, phase, mode in runs:
        print(f"# run {title}")
        print(
            f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --node-rank $NODE_RANK --rdzv-backend c10d "
            f"--rdzv-endpoint $MASTER_ADDR:29500 -m mcore_ckpt_fixes.resume.own_rank {d} {phase} {mode}"
        )
    print("# or srun (MASTER_ADDR and MASTER_PORT exported):")
    for title, phase, mode in runs:
        print(
            f"srun --nodes {nodes} --ntasks {cfg.world} --ntasks-per-node {per_node} "
            f"python -m mcore_ckpt_fixes.resume.own_rank {d} {phase} {mode}"
        )
    print(f"# then, anywhere the directory is visible:\nmcore-ckpt-fixes selftest --resume --compare {d}")
    return 0


def _compare(directory, as_json) -> int:
    from mcore_ckpt_fixes.resume import own_job

    plan_path = os.path.join(directory, "plan.json")
    if not os.path.isfile(plan_path):
        return _refuse(f"--compare {directory}: no plan.json there (written by --print-launch)")
    cfg = own_job.read_plan(plan_path)
    report = own_job.judge(own_job.read_results(directory, cfg.world), cfg.expect)
    return _finish(report, None, cfg, as_json)
