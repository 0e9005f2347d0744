"""Legacy ``torch`` checkpoints: one ``mp_rank_*`` directory per model-parallel rank.

Naming, as ``megatron.training.checkpointing.get_checkpoint_name`` writes it (identical in 0.17.1,
0.18.2 and 0.19.2, and in Megatron-LM before the wheels shipped ``megatron/training``):
``mp_rank_{tp:02d}``, then ``_{pp:03d}`` only when pipeline parallel size > 1, then ``_{ep:03d}``
only when expert parallel size > 1. So ``mp_rank_00_001`` is pp rank 1 with pp > 1 and ep = 1, or
ep rank 1 with pp = 1 and ep > 1: the name alone cannot tell. The args saved in
``model_optim_rng.pt`` (read without running code, see files and torchfile) or the sizes the run will use
decide; otherwise the layout is "ambiguous". The class depends on EP, never on pp > 1 alone.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Tuple

from . import files, sizes

MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"
_MP_RE = re.compile(r"^mp_rank_(\d{2,})(?:_(\d{3,}))?(?:_(\d{3,}))?$")


def shard_dirname(tp_rank: int, pp_rank: int = 0, ep_rank: int = 0, *, pp_size: int = 1, ep_size: int = 1) -> str:
    """The directory Megatron writes for one rank (get_checkpoint_name's rule)."""
    name = f"mp_rank_{tp_rank:02d}"
    if pp_size > 1:
        name += f"_{pp_rank:03d}"
    if ep_size > 1:
        name += f"_{ep_rank:03d}"
    return name


def expected_dirnames(tp: int, pp: int, ep: int) -> List[str]:
    return [shard_dirname(t, p, e, pp_size=pp, ep_size=ep) for p in range(pp) for t in range(tp) for e in range(ep)]


def layout_of(pp: int, ep: int) -> str:
    """The class of names written with these sizes: "1D", "2D" or "3D" (number of indices)."""
    return {0: "1D", 1: "2D", 2: "3D"}[(pp > 1) + (ep > 1)]


def parse_dirnames(names: List[str]) -> Dict[str, Tuple[int, ...]]:
    out = {}
    for name in names:
        m = _MP_RE.match(name)
        if m:
            out[name] = tuple(int(g) for g in m.groups() if g is not None)
    return out


def saved_args_info(record) -> Optional[dict]:
    """Sizes and flags from the args a rank file saved (None: it holds none)."""
    args = record.get("args") if isinstance(record, dict) else None
    if args is None:
        return None
    info = sizes.from_args(args)
    info["use_distributed_optimizer"] = bool(getattr(args, "use_distributed_optimizer", False))
    info["no_save_optim"] = bool(getattr(args, "no_save_optim", False))
    info["ckpt_format"] = getattr(args, "ckpt_format", None)
    info["iteration"] = record.get("iteration")
    return info


class RankFiles:
    """Each rank file a load would unpickle, walked once (see files.read_torch_file)."""

    def __init__(self, report, ckdir: str):
        self.report, self.ckdir = report, ckdir
        self._seen: Dict[str, Tuple[object, Optional[str]]] = {}

    def read(self, rel: str) -> Tuple[object, Optional[str]]:
        if rel not in self._seen:
            self._seen[rel] = files.read_torch_file(self.report, self.ckdir, rel)
        return self._seen[rel]


def _saved_args(report, ckdir: str, parsed, rank_files: RankFiles) -> Optional[dict]:
    """The args saved by the first rank that has a model file (rank 0's, as Megatron's tools read them)."""
    saved, args_file = None, None
    for name in sorted(parsed):
        if os.path.isfile(os.path.join(ckdir, name, MODEL_FILE)):
            args_file = os.path.join(name, MODEL_FILE)
            record, err = rank_files.read(args_file)
            saved = saved_args_info(record) if err is None else None
            if err is not None:
                report.note(f"cannot read the args in {os.path.join(ckdir, args_file)}: {err}")
            elif saved is None:
                report.note(f"{os.path.join(ckdir, args_file)} holds no saved args")
            break
    report["saved_args"] = (
        {"file": args_file, "tp": saved["tp"], "pp": saved["pp"], "ep": saved["ep"]} if saved else None
    )
    if saved:
        saved["file"] = args_file
    return saved


def _grid(parsed: Dict[str, Tuple[int, ...]], n: int) -> Tuple[int, ...]:
    """Size of each index position as seen on disk (max index + 1)."""
    dims = [0] * n
    for idx in parsed.values():
        if len(idx) == n:
            for i, v in enumerate(idx):
                dims[i] = max(dims[i], v + 1)
    return tuple(dims)


def _second_index_from_run(run: dict) -> Tuple[Optional[str], str]:
    """What the run takes the second of two indices for, from --pp / --ep as given (None: not told)."""
    pp, ep = run.get("pp"), run.get("ep")
    if pp is not None and ep is not None:
        if (pp > 1) != (ep > 1):
            return ("pp" if pp > 1 else "ep"), f"from the sizes given (--pp {pp} --ep {ep})"
        return None, f"the sizes given (--pp {pp} --ep {ep}) expect {layout_of(pp, ep)} names"
    if pp is not None:
        return (
            ("pp", f"from --pp {pp}: with pp > 1, two indices mean ep = 1")
            if pp > 1
            else ("ep", f"from --pp {pp}: with pp = 1 only ep > 1 adds a second index")
        )
    if ep is not None:
        return (
            ("ep", f"from --ep {ep}: with ep > 1, two indices mean pp = 1")
            if ep > 1
            else ("pp", f"from --ep {ep}: with ep = 1 only pp > 1 adds a second index")
        )
    return None, "no --pp/--ep given"


def analyze(report, ckdir: str, names: List[str], run: dict) -> None:
    """Fill ``report`` for a legacy checkpoint directory; ``run`` holds the sizes given (None: not given)."""
    parsed = parse_dirnames(names)
    report["format"] = "torch"
    report["format_reason"] = f"{len(parsed)} mp_rank_* directories (legacy torch format)"
    n = _index_count(report, parsed)
    rank_files = RankFiles(report, ckdir)
    saved = _saved_args(report, ckdir, parsed, rank_files)
    disk = _grid(parsed, n)
    layout, second = _classify(report, n, saved, run)
    table = _sizes(n, disk, second, saved, run)
    report["sizes"] = table
    tp, pp, ep = (table[d]["used"] for d in ("tp", "pp", "ep"))
    expected_set = _compare_names(report, parsed, disk, tp, pp, ep)
    _loader(report, layout, n, second, ep)
    _name_problems(report, n, second, pp, ep)
    _size_problems(report, saved, run)
    _file_problems(report, ckdir, [p for p in sorted(parsed) if p in expected_set], saved, rank_files)


def _index_count(report, parsed) -> int:
    """How many indices the names carry (the most common count); mixed counts are a problem."""
    counts: Dict[int, int] = {}
    for idx in parsed.values():
        counts[len(idx)] = counts.get(len(idx), 0) + 1
    if len(counts) > 1:
        report.problem(
            "mixed-layout",
            "mp_rank_* directories with different numbers of indices side by side ("
            + ", ".join(f"{c} with {k}" for k, c in sorted(counts.items()))
            + "): two saves with different parallel sizes wrote into the same iteration directory",
        )
    return max(counts, key=lambda k: (counts[k], k))


def _classify(report, n: int, saved: Optional[dict], run: dict) -> Tuple[str, Optional[str]]:
    """(layout class, what the second of two indices means) and why, into ``report``."""
    second = None
    if n == 1:
        layout, reason = "1D", "one index, mp_rank_{tp:02d}: saved with pp = 1 and ep = 1"
    elif n == 3:
        layout, reason = "3D", "three indices, mp_rank_{tp:02d}_{pp:03d}_{ep:03d}: saved with pp > 1 and ep > 1"
    else:
        if saved and saved["pp"] is not None and saved["ep"] is not None and (saved["pp"] > 1) != (saved["ep"] > 1):
            second = "pp" if saved["pp"] > 1 else "ep"
            how = f"saved args: pipeline_model_parallel_size={saved['pp']}, expert_model_parallel_size={saved['ep']}"
        else:
            if saved:
                report.problem(
                    "args-mismatch",
                    f"two indices on disk, but the saved args say pp={saved['pp']} ep={saved['ep']}, "
                    f"which Megatron names {layout_of(saved['pp'] or 1, saved['ep'] or 1)}",
                )
            second, how = _second_index_from_run(run)
            if second is None and not saved:
                how = "no readable saved args and " + how
        if second == "pp":
            layout, reason = "2D", f"two indices, mp_rank_{{tp:02d}}_{{pp:03d}}: pp > 1, ep = 1 ({how})"
        elif second == "ep":
            layout, reason = (
                "2D",
                (
                    f"two indices, mp_rank_{{tp:02d}}_{{ep:03d}}: the second index is the EP rank "
                    f"(pp = 1, ep > 1; {how})"
                ),
            )
        else:
            layout, reason = (
                "ambiguous",
                (
                    "two indices, mp_rank_{tp:02d}_{xxx:03d}: pipeline rank (pp > 1, ep = 1) or expert rank "
                    f"(pp = 1, ep > 1), the names cannot tell ({how})"
                ),
            )
            report.problem(
                "ambiguous-layout",
                "mp_rank_TT_XXX names are pp ranks (pp > 1) or ep ranks (pp = 1, ep > 1); nothing tells which: "
                "give the run's --pp and --ep",
            )
    report["layout"] = layout
    report["layout_reason"] = reason
    report["second_index"] = second if n == 2 else None
    return layout, second


def _sizes(n: int, disk, second: Optional[str], saved: Optional[dict], run: dict) -> dict:
    """Per dimension: the size used, where it came from, the saved one and the one the names span."""
    on_disk = {"tp": disk[0] if disk else None, "pp": 1, "ep": 1}
    if n == 3:
        on_disk.update(pp=disk[1], ep=disk[2])
    elif n == 2 and second:
        on_disk[second] = disk[1]
    sizes = {}
    for dim in ("tp", "pp", "ep"):
        given = run.get(dim)
        saved_v = saved.get(dim) if saved else None
        known = n != 2 or second is not None or dim == "tp"
        if given is not None:
            used, source = given, "given"
        elif saved_v is not None:
            used, source = saved_v, f"saved args in {saved['file']}"
        elif known:
            used, source = on_disk[dim], "directories on disk"
        else:
            used, source = None, "unknown"
        sizes[dim] = {"used": used, "source": source, "saved": saved_v, "on_disk": on_disk[dim] if known else None}
    return sizes


def _compare_names(report, parsed, disk, tp, pp, ep) -> set:
    """Expected, present, missing and extra directory names into ``report``; the expected set back."""
    present = sorted(parsed)
    if pp is not None and ep is not None and tp is not None:
        expected = expected_dirnames(tp, pp, ep)
    else:  # ambiguous and nothing given: compare with the grid the names themselves span
        expected = [f"mp_rank_{t:02d}_{x:03d}" for t in range(disk[0]) for x in range(disk[1])]
    expected_set = set(expected)
    missing = sorted(e for e in expected if e not in parsed)
    extra = [p for p in present if p not in expected_set]
    report["expected"], report["on_disk"], report["missing"], report["extra"] = (
        sorted(expected),
        present,
        missing,
        extra,
    )
    return expected_set


def _loader(report, layout: str, n: int, second: Optional[str], ep: Optional[int]) -> None:
    needs_ep = (ep is not None and ep > 1) or n == 3 or second == "ep" or layout == "ambiguous"
    report["loader"] = "ep-aware" if needs_ep else "non-ep"
    if layout == "ambiguous":
        report["loader_reason"] = (
            "a loader that ignores EP reads the second index as the pipeline rank; only one "
            "that knows the expert parallel size reads either case right"
        )
    elif needs_ep:
        report["loader_reason"] = "the names carry an expert-parallel index (ep > 1): the loader must branch on EP"
    else:
        report["loader_reason"] = "no expert-parallel index (ep = 1): a loader that branches on pp alone reads it"


def _name_problems(report, n: int, second: Optional[str], pp: Optional[int], ep: Optional[int]) -> None:
    missing, extra, expected = report["missing"], report["extra"], report["expected"]
    if missing:
        report.problem(
            "missing-shard-dirs",
            f"{len(missing)} of {len(expected)} directories the run needs are not on disk: "
            + ", ".join(missing[:8])
            + (" ..." if len(missing) > 8 else "")
            + f" (that rank fails with: No such file or directory: '.../{missing[0]}/{MODEL_FILE}')",
            names=missing,
        )
    if extra:
        report.problem(
            "extra-shard-dirs",
            f"{len(extra)} directories on disk that the run will not read: "
            + ", ".join(extra[:8])
            + (" ..." if len(extra) > 8 else "")
            + " (saved with other parallel sizes: their weights would be silently ignored)",
            names=extra,
        )
    # Same names, different meaning: saved with pp = 1, ep = 2 and read with pp = 2, ep = 1 (or back).
    if n == 2 and second and pp is not None and ep is not None:
        run_second = "pp" if pp > 1 else "ep" if ep > 1 else None
        if run_second and run_second != second:
            report.problem(
                "index-meaning-mismatch",
                f"two-index names on disk and in this run, but on disk the second index is the {second} rank and this run reads it as "
                f"the {run_second} rank: every rank would load another rank's weights",
            )


def _size_problems(report, saved: Optional[dict], run: dict) -> None:
    if not saved:
        return
    diffs = [
        f"{d}: saved {saved[d]}, run {run[d]}"
        for d in ("tp", "pp", "ep")
        if run.get(d) is not None and saved.get(d) is not None and run[d] != saved[d]
    ]
    if diffs:
        report.problem(
            "size-mismatch",
            "the run's sizes differ from the saved ones ("
            + "; ".join(diffs)
            + "): the legacy torch format is not resharded on load (convert it, or save with torch_dist)",
        )


def _file_problems(report, ckdir: str, dirs: List[str], saved: Optional[dict], rank_files: RankFiles) -> None:
    """Every file the run's ranks would open: present, and walked without running its pickle."""
    want_optim = bool(saved and saved["use_distributed_optimizer"] and not saved["no_save_optim"])
    lacking = []
    for name in dirs:
        for fname in (MODEL_FILE, OPTIM_FILE) if want_optim else (MODEL_FILE,):
            rel = os.path.join(name, fname)
            if not os.path.isfile(os.path.join(ckdir, rel)):
                lacking.append(rel)
            else:
                rank_files.read(rel)
    if lacking:
        report.problem(
            "missing-files",
            f"{len(lacking)} files missing from shard directories: "
            + ", ".join(lacking[:8])
            + (" ..." if len(lacking) > 8 else ""),
            names=lacking,
        )
