"""The next step for each finding: what a user does about it (``remedy`` in the JSON, ``next:`` in
the text). Findings whose text depends on the checkpoint (which earlier iteration is intact) get it
from :func:`add_fallback`; the rest read this table."""

from __future__ import annotations

import os
from typing import Optional

from .tracker import TRACKER, iteration_dirname

RESTORE = "restore it from a copy (or re-save this iteration)"
BY_CODE = {
    "unsafe-pickle": "do not load this checkpoint with Megatron (torch.load(weights_only=False) would run it) "
    "until the file is replaced from a copy you trust; find out who could write to it",
    "damaged-file": f"{RESTORE}: every rank that opens it fails to load",
    "unreadable-file": "fix the file's permissions (chmod a+r), or run as a user who can read it, or " + RESTORE,
    "data-files": f"{RESTORE}: copy the missing or cut .distcp files back; a load reads them all",
    "incomplete-save": "this save did not finish: resume from an earlier iteration, or save again",
    "missing-metadata-json": "if the save finished (every .distcp and .metadata present), restore metadata.json "
    "from another iteration of the same run; otherwise resume from an earlier iteration",
    "metadata-json-unreadable": "restore metadata.json from another iteration of the same run (it holds only the "
    "backend name and version)",
    "unsupported-backend": "load it with the tool that wrote it, or convert it to torch_dist",
    "chunk-coverage": f"{RESTORE}: the index does not describe every tensor whole. torch DCP's save-plan "
    "validation refuses chunks that overlap, leave their tensor or leave part of it unwritten: a save that "
    "wrote them ran with that validation switched off (ms-swift's init_megatron_env does so; "
    "mcore_ckpt_fixes.other_patches.found() in the training process names such patches)",
    "common-state-missing": f"{RESTORE}: without the common state a load has no args and no iteration",
    "expert-key-collision": "re-save from the run that wrote it with the expert-keys fix applied "
    "(import mcore_ckpt_fixes); the experts whose keys collided are not in this checkpoint",
    "expert-missing": "re-save with every expert-parallel rank writing; the missing experts are not in this checkpoint",
    "expert-duplicate": "remove one spelling of the duplicated keys (re-save with one expert layout)",
    "rng-2d-under-ep": "resume with mcore_ckpt_fixes imported (fix rng-under-ep: EP ranks get their (pp, tp) copy "
    "with a warning and later saves keep every rank's own state), or resume with "
    "--no-load-rng to start fresh RNG streams",
    "rng-layout-mixed": "resume with --no-load-rng (the RNG states cannot all be read back as one layout)",
    "rng-incomplete": "resume with --no-load-rng (some ranks' RNG states are not in the checkpoint)",
    "tracker-missing": f"write the iteration to resume from into {TRACKER} (e.g. echo 1000 > {TRACKER})",
    "tracker-invalid": f"write an integer iteration or 'release' into {TRACKER}",
    "tracker-missing-iteration": f"point {TRACKER} at an iteration that is on disk",
    "iteration-missing": "pick an iteration that is on disk (--iteration N)",
    "iteration-mismatch": "give the iteration of the directory, or the checkpoint root",
    "empty-iteration": "resume from another iteration; this directory holds no checkpoint",
    "mixed-formats": "move the mp_rank_* directories out of the iteration directory (Megatron reads torch_dist)",
    "mixed-layout": "keep the directories of one save only (those matching the run's sizes)",
    "ambiguous-layout": "give the run's sizes: --pp N --ep N",
    "args-mismatch": "give the run's sizes (--tp --pp --ep) to tell which directories it reads",
    "missing-shard-dirs": "run with the sizes the checkpoint was saved with, or restore the missing directories",
    "extra-shard-dirs": "run with the sizes the checkpoint was saved with (the legacy format is not resharded)",
    "index-meaning-mismatch": "run with the saved sizes, or convert the checkpoint to torch_dist to change them",
    "size-mismatch": "run with the saved sizes, or convert the checkpoint to torch_dist (resharded on load)",
    "missing-files": f"{RESTORE}: every rank opens its own files",
    "integrity-mismatch": f"{RESTORE}: the files no longer match the integrity manifest the save wrote "
    "(integrity.json); check a copy with `inspect --verify-hashes` before trusting it",
    "integrity-unlisted": "if the file is not yours, restore the iteration from a copy; if it is, re-save so that "
    "integrity.json covers it (or remove it)",
    "unreadable": "give a checkpoint root (with its tracker) or an iter_* directory",
}
# Findings that make the inspected iteration unloadable: an earlier intact one is worth naming.
UNLOADABLE = {
    "unsafe-pickle",
    "damaged-file",
    "unreadable-file",
    "data-files",
    "incomplete-save",
    "missing-metadata-json",
    "metadata-json-unreadable",
    "chunk-coverage",
    "common-state-missing",
    "missing-files",
    "empty-iteration",
    "integrity-mismatch",
}


def for_code(code: str) -> Optional[str]:
    return BY_CODE.get(code)


def add_fallback(report, root: str, broken: Optional[int], intact: Optional[int], tried: int) -> None:
    """Extend each unloadable finding's remedy with the newest earlier iteration that is intact
    (``tried``: how many earlier iterations were inspected)."""
    if broken is None:
        return
    if intact is None:
        step = (
            f"none of the {tried} earlier iterations inspected can load either"
            if tried
            else "there is no earlier iteration on disk to resume from"
        )
    else:
        tracker = os.path.join(root, TRACKER)
        step = (
            f"{iteration_dirname(intact)} is intact: move {iteration_dirname(broken)} aside and run "
            f"`echo {intact} > {tracker}` to resume from it"
        )
    report["fallback_iteration"] = intact
    for p in report.problems:
        if p["code"] in UNLOADABLE:
            p["remedy"] = f"{p['remedy']}; {step}" if p.get("remedy") else step
