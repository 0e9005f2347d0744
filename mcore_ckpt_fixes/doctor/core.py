"""Find the iteration directory (tracker vs ``iter_*``), tell the format, hand over to its reader."""

from __future__ import annotations

import os
from typing import Optional

from . import dcp, integrity, legacy, remedies, tracker
from .report import Report, Unreadable


def _listdir(path: str):
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        raise Unreadable(f"{path}: no such directory") from None
    except NotADirectoryError:
        raise Unreadable(f"{path} is not a directory (give the checkpoint root or an iter_* directory)") from None
    except OSError as exc:
        raise Unreadable(f"cannot list {path}: {exc.strerror or exc}") from None


def _is_checkpoint_dir(names) -> bool:
    return bool(legacy.parse_dirnames(names)) or dcp.is_distributed(names)


def inspect(
    path: str,
    *,
    tp: Optional[int] = None,
    pp: Optional[int] = None,
    ep: Optional[int] = None,
    iteration: Optional[int] = None,
    verify_hashes: bool = False,
    _fallback: bool = True,
) -> Report:
    """Inspect the checkpoint at ``path`` (its root, or one ``iter_*`` directory) for a run with the given
    sizes (None: not given). Raises :class:`Unreadable` when there is nothing readable to inspect.

    ``verify_hashes``: compare the digests of Megatron-Core's integrity manifest (``integrity.json``)
    with the files, which reads every byte of every listed file (tensor payloads included); by default
    the manifest is checked from metadata only (see integrity)."""
    report = _inspect(path, tp, pp, ep, iteration, verify_hashes)
    if _fallback and any(p["code"] in remedies.UNLOADABLE for p in report.problems):
        _name_intact_iteration(report, tp, pp, ep)
    return report


MAX_FALLBACK_TRIES = 3  # earlier iterations inspected when the chosen one cannot load


def _name_intact_iteration(report: Report, tp, pp, ep) -> None:
    """The inspected iteration cannot load: find the newest earlier one that can, for the remedy."""
    ckdir = report.get("checkpoint_dir")
    broken = report.get("iteration")
    if not ckdir or broken is None:
        return
    root = os.path.dirname(ckdir)
    try:
        earlier = [i for i in tracker.iterations_on_disk(root, os.listdir(root)) if i < broken]
    except OSError:
        return
    intact, tried = None, earlier[-MAX_FALLBACK_TRIES:]
    for it in reversed(tried):
        try:
            other = inspect(os.path.join(root, tracker.iteration_dirname(it)), tp=tp, pp=pp, ep=ep, _fallback=False)
        except Unreadable:
            continue
        if not any(p["code"] in remedies.UNLOADABLE for p in other.problems):
            intact = it
            break
    remedies.add_fallback(report, root, broken, intact, len(tried))


def _inspect(path: str, tp, pp, ep, iteration, verify_hashes: bool = False) -> Report:
    run = {"tp": tp, "pp": pp, "ep": ep}
    path = os.path.abspath(path)
    report = Report(path)
    names = _listdir(path)
    if _is_checkpoint_dir(names):
        ckdir = path
        _, it = tracker.parse_dirname(os.path.basename(path))
        report["iteration"] = it
        report["release"] = os.path.basename(path) == "release"
        if iteration is not None and it is not None and iteration != it:
            report.problem("iteration-mismatch", f"--iteration {iteration} given, but {path} is iteration {it}")
    else:
        ckdir = _choose_iteration(report, path, names, iteration)
        if ckdir is None:
            return report
    report["checkpoint_dir"] = ckdir
    ck_names = _listdir(ckdir)
    has_legacy = bool(legacy.parse_dirnames(ck_names))
    has_dist = dcp.is_distributed(ck_names)
    if has_legacy and has_dist:
        report.problem(
            "mixed-formats",
            "mp_rank_* directories and distributed checkpoint files in one directory: "
            "Megatron picks torch_dist and ignores the mp_rank_* directories",
        )
    if has_dist:
        dcp.analyze(report, ckdir, ck_names, run)
    elif has_legacy:
        legacy.analyze(report, ckdir, ck_names, run)
    else:
        report.problem(
            "empty-iteration",
            f"{ckdir} holds no mp_rank_* directories and no distributed checkpoint "
            "files (.metadata, .distcp, metadata.json)",
        )
    integrity.check(report, ckdir, ck_names, verify_hashes)
    return report


def _choose_iteration(report: Report, root: str, names, iteration: Optional[int]) -> Optional[str]:
    raw, tr_iter, tr_release, tr_err = tracker.read_tracker(root)
    on_disk = tracker.iterations_on_disk(root, names)
    has_release = os.path.isdir(os.path.join(root, "release"))
    report["iterations_on_disk"] = on_disk
    if raw is None and not on_disk and not has_release:
        raise Unreadable(
            f"{root} is not a Megatron checkpoint: no {tracker.TRACKER}, no iter_*/release directories, "
            "no mp_rank_* directories and no distributed checkpoint files"
        )
    newest = tracker.iteration_dirname(on_disk[-1]) if on_disk else ("release" if has_release else None)
    if raw is None:
        summary = f"{tracker.TRACKER} missing"
    elif tr_err:
        summary = f"{tracker.TRACKER} invalid"
    else:
        summary = f"{tracker.TRACKER} says {'release' if tr_release else tr_iter}"
    report["tracker"] = {
        "file": tracker.TRACKER,
        "present": raw is not None,
        "value": raw,
        "iteration": tr_iter,
        "release": tr_release,
        "summary": summary,
    }

    if raw is None:
        report.problem(
            "tracker-missing",
            f"no {tracker.TRACKER}: Megatron's load_checkpoint warns and starts from scratch (random weights, "
            f"iteration 0) although {newest} is on disk",
        )
    elif tr_err:
        report.problem("tracker-invalid", tr_err)

    if iteration is not None:
        chosen = tracker.iteration_dirname(iteration)
        report["iteration"] = iteration
        if not tr_err and raw is not None and not tr_release and tr_iter != iteration:
            report.note(
                f"--iteration {iteration} given; the tracker says {tr_iter} (Megatron loads that one "
                "unless --ckpt-step is set)"
            )
        if not os.path.isdir(os.path.join(root, chosen)):
            report.problem(
                "iteration-missing", f"{chosen} does not exist (on disk: {_list_iters(on_disk, has_release)})"
            )
            return None
        return os.path.join(root, chosen)

    if raw is not None and not tr_err:
        chosen = tracker.iteration_dirname(None if tr_release else tr_iter)
        report["iteration"] = tr_iter
        report["release"] = tr_release
        if not os.path.isdir(os.path.join(root, chosen)):
            report.problem(
                "tracker-missing-iteration",
                f"{tracker.TRACKER} says {raw!s} but {chosen} does not exist: Megatron fails to load "
                f"(on disk: {_list_iters(on_disk, has_release)})",
            )
            return None
        _newer_than_the_tracker(report, root, [i for i in on_disk if tr_iter is not None and i > tr_iter])
        return os.path.join(root, chosen)

    # No usable tracker: inspect what a user would look at next, the newest directory.
    if newest is None:
        return None
    _, it = tracker.parse_dirname(newest)
    report["iteration"] = it
    report["release"] = newest == "release"
    report.note(f"inspecting the newest directory on disk, {newest}")
    return os.path.join(root, newest)


def _newer_than_the_tracker(report: Report, root: str, later) -> None:
    """Iteration directories past the tracker's: each one named with what it lacks (a save that
    died before finishing) or as finished but never recorded. Megatron loads the tracker's."""
    newer = []
    for it in later:
        name = tracker.iteration_dirname(it)
        state = tracker.unfinished_save(os.path.join(root, name))
        newer.append({"iteration": it, "directory": name, "complete": state is None, "state": state or "finished"})
        report.note(
            f"{name}, newer than the tracker's: "
            + (state or "a finished save the tracker does not record (the save stopped before updating it)")
            + "; Megatron loads the tracker's iteration"
        )
    if newer:
        report["newer_iterations"] = newer


def _list_iters(on_disk, has_release) -> str:
    items = [tracker.iteration_dirname(i) for i in on_disk] + (["release"] if has_release else [])
    if not items:
        return "none"
    return ", ".join(items[-5:]) + (f" ({len(items)} in all)" if len(items) > 5 else "")
