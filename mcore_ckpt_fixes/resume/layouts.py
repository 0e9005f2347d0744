"""Resume on another layout: a job saves on one parallel layout and resumes on another.

Per change (:data:`CHANGES`), with the fixes at their defaults and with every fix off: a world of
the saved layout trains :data:`~.check.RESUME_AT` steps and saves (``save_checkpoint``); a world of
the new layout loads it (``load_checkpoint``), saves what it loaded at once, before any step, as its
own layout writes it (the ``reload`` phase of :mod:`..testing.gpt_job`), and trains the remaining
steps. The two checkpoints are then read back here as full tensors (every tensor of the
``torch_dist`` checkpoint at its global shape, through DCP without a process group) and compared
bit for bit, key by key: every parameter, the fp32 main parameters and the Adam moments of a
``fully_reshardable`` optimizer (``step`` lives in its param groups, in the common state), and of the
common state the iteration, the scheduler and the optimizers' own entries (where the expert-parallel
size changed, and with it how many optimizers the job chains, by kind: ``optimizer_state_by_kind``).
What only one layout can carry is left out, by name:
the RNG states and the rerun state machine (per rank: ``load_checkpoint`` ignores them where the
layout changed), and the arguments the run was started with.

Verdicts per change and mode: ``exact`` (the same keys, every tensor the same bits; the iteration
and the scheduler the same), ``refused`` (the new layout's load failed: the error, which the
release must give too), ``differs`` (loaded, but something differs: a defect). With the fixes the
verdict must be the release's own where the release is exact or refuses ("never worse").
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

from ..testing.full_state import chain_length, common_state, full_tensors, latest_iteration_dir, optimizer_state_by_kind
from ..testing.job_config import LAYOUT_GLOBAL_BATCH, Config, moe_for_layout_change
from . import check

# Common-state entries a layout change may legitimately change (module doc).
PER_LAYOUT = ("args", "rng_state", "rerun_state_machine")


@dataclass(frozen=True)
class Change:
    name: str
    saved: Config
    loaded: Config


def _dense(name, world, tp=1, pp=1, vpp=0, optim_format="fully_reshardable", layers=0) -> Config:
    return Config(
        name,
        f"dense GPT, TP={tp} PP={pp} VPP={vpp or 1} on {world} ranks ({optim_format})",
        world=world,
        tp=tp,
        pp=pp,
        vpp=vpp,
        optim_format=optim_format,
        layers=layers,
        global_batch=LAYOUT_GLOBAL_BATCH,
    )


CHANGES = (
    Change("tp2-to-tp1", _dense("tp2", 2, tp=2), _dense("tp1-dp2", 2)),
    Change("tp1-to-tp2", _dense("tp1-dp2", 2), _dense("tp2", 2, tp=2)),
    Change("pp1-to-pp2", _dense("tp1-dp2", 2), _dense("pp2", 2, pp=2)),
    Change("pp2-to-pp1", _dense("pp2", 2, pp=2), _dense("tp1-dp2", 2)),
    # Four layers on both sides: one per virtual stage, or two per stage.
    Change("vpp2-to-vpp1", _dense("pp2-vpp2", 2, pp=2, vpp=2), _dense("pp2-4l", 2, pp=2, layers=4)),
    Change("vpp1-to-vpp2", _dense("pp2-4l", 2, pp=2, layers=4), _dense("pp2-vpp2", 2, pp=2, vpp=2)),
    Change("dp2-to-dp4", _dense("dp2", 2), _dense("dp4", 4)),
    Change("dp4-to-dp2", _dense("dp4", 4), _dense("dp2", 2)),
    Change("dp2-to-dp1", _dense("dp2", 2), _dense("dp1", 1)),
    Change("ep2-to-ep1", moe_for_layout_change("ep2", 2, 2), moe_for_layout_change("ep1-dp2", 2, 1)),
    Change("ep1-to-ep2", moe_for_layout_change("ep1-dp2", 2, 1), moe_for_layout_change("ep2", 2, 2)),
    Change("tp2pp1-to-tp1pp2", _dense("tp2", 2, tp=2), _dense("pp2", 2, pp=2)),
    Change(
        "dp2-to-dp4-dp-reshardable",
        _dense("dp2-dpr", 2, optim_format="dp_reshardable"),
        _dense("dp4-dpr", 4, optim_format="dp_reshardable"),
    ),
    Change(
        "tp2-to-tp1-dp-reshardable",
        _dense("tp2-dpr", 2, tp=2, optim_format="dp_reshardable"),
        _dense("tp1-dp2-dpr", 2, optim_format="dp_reshardable"),
    ),
)


def by_name(name: str) -> Change:
    for change in CHANGES:
        if change.name == name:
            return change
    raise KeyError(f"unknown layout change {name!r}; known: {', '.join(c.name for c in CHANGES)}")


def compare(saved_root: str, loaded_root: str) -> dict:
    """The two checkpoints as full tensors and common state: what differs, by name."""
    from .compare import same

    saved_dir, loaded_dir = latest_iteration_dir(saved_root), latest_iteration_dir(loaded_root)
    a, b = full_tensors(saved_dir), full_tensors(loaded_dir)
    differ = sorted(k for k in set(a) | set(b) if k not in a or k not in b or not same(a[k], b[k]))
    ca, cb = common_state(saved_dir), common_state(loaded_dir)
    for key in sorted((set(ca) | set(cb)) - set(PER_LAYOUT)):
        if key not in ca or key not in cb or not _same_common(key, ca[key], cb[key]):
            differ.append(f"common:{key}")
    return {"n_compared": len(set(a) | set(b)), "differ": differ}


def _same_common(key, a, b) -> bool:
    """Whether two common-state entries are equal; the optimizer's, where the two jobs chain another
    number of optimizers (an expert-parallel size changed), by kind (:func:`optimizer_state_by_kind`)."""
    from .compare import same

    if same(a, b):
        return True
    if key != "optimizer" or chain_length(a) == chain_length(b):
        return False
    return optimizer_state_by_kind(a) == optimizer_state_by_kind(b)


def _world(cfg, phase, ckpt_dir, mode, device, timeout):
    return check.run_phase(cfg, phase, ckpt_dir, check.MODES[mode], device, timeout)


def _one_mode(change, mode, device, timeout) -> dict:
    from ..testing.gpt_job import reference, resaved

    root = tempfile.mkdtemp(prefix=f"mcore-ckpt-fixes-layouts-{change.name}-{mode}-")
    saved = os.path.join(root, "saved")
    try:
        _, error, detail = _world(change.saved, "reference", saved, mode, device, timeout)
        if error:
            return {"verdict": "error", "error": error, "detail": detail}
        values, error, detail = _world(change.loaded, "reload", saved, mode, device, timeout)
        if error:
            return {"verdict": "refused", "error": error, "detail": detail}
        out = {"iteration": sorted({v["iteration"] for v in values}), **compare(reference(saved), resaved(saved))}
        out["load_warnings"] = sorted({w for v in values for w in v["load_warnings"]})
        exact = not out["differ"] and out["iteration"] == [check.RESUME_AT]
        return {"verdict": "exact" if exact else "differs", **out}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def release_line(verdict: dict) -> str:
    """The one line a refusal is known by: its last line, without the rank that raised it first."""
    if verdict["verdict"] != "refused":
        return verdict["verdict"]
    return verdict["error"].split(": ", 2)[-1]


def run_change(change: Change, device: str = "cpu", modes=("on", "off"), timeout: float = 240.0) -> dict:
    """One change's report: per mode its verdict, and whether the fixes are never worse than the
    release (``as_release``: with them exact where the release is exact, and refusing with the
    release's own error where it refuses)."""
    out = {"change": change.name, "saved": change.saved.name, "loaded": change.loaded.name}
    for mode in modes:
        out[mode] = _one_mode(change, mode, device, timeout)
    if "on" in out and "off" in out:
        on, off = out["on"], out["off"]
        out["as_release"] = (
            on["verdict"] == "exact"
            if off["verdict"] == "exact"
            else (on["verdict"] == "exact" or release_line(on) == release_line(off))
        )
    return out
