"""``python -m mcore_ckpt_fixes`` / ``mcore-ckpt-fixes``: status, selftest, inspect."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


class _Parser(argparse.ArgumentParser):
    """Bad usage: one line on stderr and exit 2, no usage block (subparsers inherit this class)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _fix_ids(text, resume):
    """``selftest --fix``'s ids in the registry's order (None: every fix), or why they are refused."""
    if text is None:
        return None
    if resume:
        return "--fix goes with the round trips, not --resume (the resume check trains whole configurations)"
    from .fixes import ORDER

    asked = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [part for part in asked if part not in ORDER]
    if unknown or not asked:
        return f"--fix {text!r}: unknown fix id {', '.join(map(repr, unknown)) or '(none given)'}; accepted: {', '.join(ORDER)}"
    return [fix_id for fix_id in ORDER if fix_id in asked]


def _own_job_usage(args) -> str:
    """Why the own-job options are refused together ('' when they are not)."""
    job = args.megatron_args is not None or args.megatron_args_file is not None
    if (job or args.compare or args.allow_drop or args.print_launch) and not args.resume:
        return "--megatron-args, --megatron-args-file, --allow-drop, --print-launch and --compare go with --resume"
    if args.compare and (job or args.print_launch):
        return "--compare judges runs already made: give it alone, without the job's arguments"
    if (args.print_launch or args.allow_drop) and not job:
        return "--print-launch and --allow-drop need the job's arguments (--megatron-args or --megatron-args-file)"
    if (job or args.compare) and args.config is not None:
        return "--config names the built-in configurations; your own job is given by --megatron-args"
    return ""


def _add_own_job(p_self) -> None:
    """``selftest --resume``'s options for the user's own job."""
    own = p_self.add_argument_group("your own job (with --resume)")
    own.add_argument(
        "--megatron-args",
        metavar="ARGS",
        default=None,
        help="check your own job: its pretrain_gpt.py arguments, in one string; parsed and validated by "
        "this Megatron release, the model shrunk, everything else kept",
    )
    own.add_argument(
        "--megatron-args-file",
        metavar="FILE",
        default=None,
        help="the same from a launch script (torchrun ... pretrain_gpt.py ${ARGS[@]}) or an argument file; "
        "with --megatron-args too, those come after the file's",
    )
    own.add_argument(
        "--allow-drop",
        action="store_true",
        help="run without what this host cannot keep (Transformer Engine, fp8, flash attention, a world too "
        "large ...); without it the check refuses, naming them",
    )
    own.add_argument(
        "--print-launch",
        metavar="DIR",
        default=None,
        help="write the shrunk job to DIR and print the torchrun / srun commands of each run, for a job "
        "whose world does not fit this host",
    )
    own.add_argument(
        "--compare",
        metavar="DIR",
        default=None,
        help="judge the runs that --print-launch's commands wrote into DIR",
    )


def _add_selftest(sub) -> None:
    p_self = sub.add_parser(
        "selftest",
        help="run every fix's checkpoint round trips on this stack, with the fix off and on",
        description="Run every fix's checkpoint round trips on this Megatron-Core, torch and device, with "
        "the fix off (the bug must show where the release needs the fix) and on (every tensor must come "
        "back exactly on every rank). Exit 0 only when every fix this release needs is exact with the fix "
        "on; 1 otherwise; 2 for bad usage.",
    )
    p_self.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo, forked ranks (default); cuda: NCCL, one GPU per rank",
    )
    p_self.add_argument(
        "--nproc",
        type=_positive_int,
        default=None,
        help="run only the scenarios written for this many ranks (default: every scenario, "
        "each at the world size it is written for); with --resume: the configurations of up to this "
        "many ranks (default 2; 8 runs every layout)",
    )
    p_self.add_argument(
        "--config",
        metavar="NAME[,NAME...]",
        default=None,
        help="with --resume: run only these configurations (comma-separated names, as docs/resume.md lists them)",
    )
    p_self.add_argument(
        "--fix",
        metavar="ID[,ID...]",
        default=None,
        help="run only these fixes' round trips (comma-separated fix ids, as `status` lists them); "
        "the others are left out of the report and of the verdict",
    )
    p_self.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list of objects, one per fix (with --resume: one per configuration)",
    )
    p_self.add_argument(
        "--resume",
        action="store_true",
        help="run the resume check instead: train, save, stop, resume in new processes, and "
        "compare with the uninterrupted run bit for bit, with the fixes on and off",
    )
    _add_own_job(p_self)
    p_self.add_argument(
        "--attribution",
        action="store_true",
        help="with --resume: also resume each configuration that needs fixes with only those fixes on "
        "(MCORE_CKPT_FIXES=<its fixes>, every other off); it must be exact too",
    )


def _build_parser() -> "_Parser":
    parser = _Parser(
        prog="mcore-ckpt-fixes",
        description="Fixes for Megatron-Core distributed checkpointing: see which apply here.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p_status = sub.add_parser("status", help="list every fix and its state in this environment")
    p_status.add_argument("--json", action="store_true", help="print a JSON list of objects")
    p_status.add_argument(
        "--no-import",
        action="store_true",
        help="do not import the Megatron-Core modules the fixes target (their fixes stay 'pending')",
    )
    p_status.add_argument(
        "--known-bugs",
        action="store_true",
        help="list the catalogued checkpoint bugs that affect this Megatron-Core release instead, with their "
        "status here (docs/known-bugs.md); with --json one object",
    )
    _add_selftest(sub)
    p_insp = sub.add_parser(
        "inspect",
        help="the checkpoint doctor: what is on disk and whether a run with these sizes can read it",
        description="Inspect a Megatron checkpoint (its root with latest_checkpointed_iteration.txt, or one "
        "iter_* directory) from its metadata only: tracker vs iter_* directories, format, the legacy mp_rank_* "
        "layout against the run's sizes, chunk coverage, expert keys, RNG and common-state layout, and which "
        "Megatron-Core releases can read it. Exit 0 clean, 1 problems found, 2 unreadable input or bad usage.",
    )
    p_insp.add_argument("checkpoint", metavar="CKPT", help="checkpoint root or iter_* directory")
    p_insp.add_argument("--tp", type=_positive_int, help="tensor model parallel size of the run")
    p_insp.add_argument("--pp", type=_positive_int, help="pipeline model parallel size of the run")
    p_insp.add_argument("--ep", type=_positive_int, help="expert model parallel size of the run")
    p_insp.add_argument("--iteration", type=_non_negative_int, help="inspect iter_N instead of the tracker's")
    p_insp.add_argument("--json", action="store_true", help="print one JSON object (the contract for tools)")
    p_insp.add_argument(
        "--verify-hashes",
        action="store_true",
        help="also compare the sha256 digests of Megatron-Core's integrity manifest (integrity.json): reads every "
        "byte of every listed file (without it the doctor reads metadata only)",
    )
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        import mcore_ckpt_fixes  # noqa: F401  (flags parsed here)
    except ValueError as exc:  # FlagError: one line, no traceback
        print(f"mcore-ckpt-fixes: {exc}", file=sys.stderr)
        return 2
    if args.command == "status":
        from .cli.status import run as run_status

        return run_status(as_json=args.json, import_targets_first=not args.no_import, known_bugs=args.known_bugs)
    if args.command == "selftest":
        only = _fix_ids(args.fix, args.resume)
        if isinstance(only, str):
            print(f"mcore-ckpt-fixes selftest: error: {only}", file=sys.stderr)
            return 2
        own = _own_job_usage(args)
        if own:
            print(f"mcore-ckpt-fixes selftest: error: {own}", file=sys.stderr)
            return 2
        if args.resume and (args.megatron_args or args.megatron_args_file or args.compare):
            from .cli.selftest_own import run as run_own

            return run_own(
                megatron_args=args.megatron_args,
                args_file=args.megatron_args_file,
                device=args.device,
                nproc=args.nproc,
                as_json=args.json,
                allow_drop=args.allow_drop,
                attribution=args.attribution,
                print_launch=args.print_launch,
                compare=args.compare,
            )
        if args.resume:
            from .cli.selftest_resume import run as run_resume

            names = None if args.config is None else [n.strip() for n in args.config.split(",") if n.strip()]
            return run_resume(
                device=args.device, nproc=args.nproc, as_json=args.json, attribution=args.attribution, names=names
            )
        if args.config is not None:
            print("mcore-ckpt-fixes selftest: --config goes with --resume", file=sys.stderr)
            return 2
        if args.attribution:
            print("mcore-ckpt-fixes selftest: --attribution goes with --resume", file=sys.stderr)
            return 2
        from .cli.selftest import run as run_selftest

        return run_selftest(device=args.device, nproc=args.nproc, as_json=args.json, only=only)
    if args.command == "inspect":
        from .cli.inspect import run as run_inspect

        return run_inspect(
            args.checkpoint,
            args.tp,
            args.pp,
            args.ep,
            args.iteration,
            as_json=args.json,
            verify_hashes=args.verify_hashes,
        )
    return 2


if __name__ == "__main__":
    sys.exit(main())
