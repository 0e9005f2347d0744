"""``python -m mcore_ckpt_fixes`` / ``mcore-ckpt-fixes``: status (and, as they land, more commands)."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
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
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        from .cli.status import run as run_status  # imports mcore_ckpt_fixes: flags parsed here
    except ValueError as exc:  # FlagError: one line, no traceback
        print(f"mcore-ckpt-fixes: {exc}", file=sys.stderr)
        return 2
    if args.command == "status":
        return run_status(as_json=args.json, import_targets=not args.no_import)
    return 2


if __name__ == "__main__":
    sys.exit(main())
