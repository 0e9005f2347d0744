"""Run the resume check: uninterrupted (A), saving and going on (B), resumed in new processes (C).

Per configuration (:mod:`.configs`): run A is the release's own run, every fix off
(``MCORE_CKPT_FIXES=off``), ``steps`` steps, no checkpoint; run B trains ``resume_at`` steps, saves
through ``save_checkpoint`` and trains on to ``steps``, as a training run does; run C is a new world
of new processes that builds the same job, ``load_checkpoint`` s and trains the remaining steps.
Compared per rank, bit for bit (:mod:`.compare`): C with A (the resume is exact), and B with the
fixes on with A over every step (``unchanged``: a run that never resumes is the same with the import
as without it, its saves included). B and C run twice: with the fixes at their defaults and with
every fix off, so that the report says what the fixes change on this release; on request a third
time with only the fixes the configuration declares it needs (``only``). A configuration of options
whose resume is not meant to be exact (``Config.expect`` :data:`AS_RELEASE`) holds C with the fixes
to C without them instead (the same bits, or the same error). Where a configuration lists several
ways of resuming (``Config.resume_args``), run C resumes each of them in one world and each gets its
own verdict.
"""

from __future__ import annotations

import shutil
import tempfile

from ..testing.launcher import cuda_method, run_world
from .configs import CONFIGS

MODES = {"on": {"MCORE_CKPT_FIXES": "auto"}, "off": {"MCORE_CKPT_FIXES": "off"}}
# Attribution: only the fixes the configuration declares it needs (``cfg.needs``), every other off.
ONLY = "only"


def mode_env(cfg, mode) -> dict:
    """The fix flags of one mode's runs."""
    if mode == ONLY:
        if not cfg.needs:
            raise ValueError(f"{cfg.name} needs no fix: there is nothing to attribute")
        return {"MCORE_CKPT_FIXES": ",".join(cfg.needs)}
    return MODES[mode]


STEPS, RESUME_AT = 4, 2
# Config.expect of options whose resume is not meant to equal the uninterrupted run: with the
# fixes, run C is held to run C without them (the release's own resume), not to run A.
AS_RELEASE = "as-release"


def prepare() -> None:
    """Import in the parent what every rank uses, once (forked ranks then start warm)."""
    prepare_core()
    from ..fixes.mimo_optimizer.checks.core import prepare as prepare_mimo
    from .bridge import prepare as prepare_bridge
    from .ms_swift import prepare as prepare_ms_swift
    from .verl import prepare as prepare_verl

    prepare_mimo()
    prepare_bridge()
    prepare_verl()
    prepare_ms_swift()


def prepare_core() -> None:
    """What the GPT jobs' ranks import (Megatron-Core's and megatron.training's modules)."""
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.training.arguments  # noqa: F401
    import megatron.training.checkpointing  # noqa: F401
    import megatron.training.initialize  # noqa: F401
    import megatron.training.training  # noqa: F401


def _peer_lost(error) -> bool:
    last = (error or "").strip().splitlines()[-1:]
    return bool(last) and ("Connection closed by peer" in last[0] or "Connection reset by peer" in last[0])


def run_phase(cfg, phase, ckpt_dir, env, device, timeout, steps=STEPS, resume_at=RESUME_AT):
    kwargs = dict(cfg=cfg, phase=phase, ckpt_dir=ckpt_dir, steps=steps, resume_at=resume_at, device=device)
    # On a GPU: forked where a fork can still use the GPU, else fresh interpreters (gloo still, so
    # that several ranks may share one GPU).
    method = cuda_method() if device == "cuda" else "fork"
    results = run_world(cfg.job, cfg.world, kwargs, timeout=timeout, env=env, backend="gloo", method=method)
    # A rank whose peer failed reports the lost connection; the peer's own error is the cause.
    failed = sorted((r for r in results if not r.ok), key=lambda r: _peer_lost(r.error))
    if failed:
        last = (failed[0].error or "").strip().splitlines()
        return None, f"{phase} run: rank {failed[0].rank}: {last[-1] if last else 'failed'}", failed[0].error
    return [r.value for r in results], None, None


def verdict_against(uninterrupted, values) -> dict:
    from .compare import rank_verdict

    ranks = [rank_verdict(a, c) for a, c in zip(uninterrupted, values)]
    return {"verdict": "exact" if all(r["exact"] for r in ranks) else "inexact", "ranks": ranks}


def per_way(values):
    """Run C's results per way of resuming (``cfg.resume_args``), each a list over the ranks."""
    return [list(way) for way in zip(*(v["ways"] for v in values))]


def _failed(ranks):
    """A way that raised: what a failed world reports (the first failing rank's last line), and
    every failing rank's line (two failures are the same only if these are)."""
    failed = [r for r in ranks if "error" in r]
    if not failed:
        return None
    first = failed[0]
    return {
        "verdict": "error",
        "error": f"resume run: rank {first['coords']['rank']}: {first['error']}",
        "detail": first["detail"],
        "errors": [[r["coords"]["rank"], r["error"]] for r in failed],
    }


def _overall(ways) -> str:
    verdicts = {w["verdict"] for w in ways}
    for verdict in ("differs", "inexact", "error", "as-release"):
        if verdict in verdicts:
            return verdict
    return "exact"


def _judged(cfg, uninterrupted, values) -> dict:
    """Run C against the release's own run A: one verdict, or one per way of resuming."""
    if not cfg.resume_args:
        return verdict_against(uninterrupted, values)
    ways = []
    for args, ranks in zip(cfg.resume_args, per_way(values)):
        ways.append({"args": list(args), **(_failed(ranks) or verdict_against(uninterrupted, ranks))})
    return {"verdict": _overall(ways), "ways": ways}


def ckpt_prefix(cfg, mode) -> str:
    return f"mcore-ckpt-fixes-resume-{cfg.name}-{mode}-"


def _mode(cfg, mode, uninterrupted, device, timeout):
    """B then C with this mode's flags, C compared with A; with the fixes on also B with A
    (``unchanged``). Returns that and C's values (None where a world failed)."""
    ckpt_dir = tempfile.mkdtemp(prefix=ckpt_prefix(cfg, mode))
    out = {}
    try:
        for phase in ("save", "resume"):
            values, error, detail = run_phase(cfg, phase, ckpt_dir, mode_env(cfg, mode), device, timeout)
            if error:
                return {"verdict": "error", "error": error, "detail": detail, **out}, None
            if phase == "save" and mode == "on":
                out["unchanged"] = verdict_against(uninterrupted, values)
        return {**_judged(cfg, uninterrupted, values), **out}, values
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)


def _same_error(cfg, fixed, release) -> bool:
    """Two errors the same, but for the checkpoint directory each mode saved to."""
    import re

    def unplaced(text):
        for mode in ("on", "off"):
            text = re.sub(re.escape(ckpt_prefix(cfg, mode)) + r"\w+", "<checkpoint>", text)
        return text

    return unplaced(repr(fixed)) == unplaced(repr(release))


def same_as_release(cfg, fixed_ranks, release_ranks) -> dict:
    """One resume with the fixes against the same resume without them, rank by rank: the same
    bits (every loss, parameter, optimizer tensor and scalar, RNG stream, and the iteration
    ``load_checkpoint`` returned), or the same error on the same ranks."""
    from .compare import release_rank_verdict

    fixed_error, release_error = _failed(fixed_ranks), _failed(release_ranks)
    if fixed_error or release_error:
        same = bool(fixed_error and release_error) and _same_error(cfg, fixed_error["errors"], release_error["errors"])
        if fixed_error:
            shown = {k: v for k, v in fixed_error.items() if k != "verdict"}
        else:
            shown = {"error": f"resumed, where the release failed ({release_error['error']})"}
        return {**shown, "verdict": "as-release" if same else "differs", "same": "error" if same else None}
    ranks = [release_rank_verdict(r, f) for r, f in zip(release_ranks, fixed_ranks)]
    same = all(r["exact"] for r in ranks)
    return {"verdict": "as-release" if same else "differs", "same": "bits" if same else None, "ranks": ranks}


def _against_release(cfg, on, on_values, off, off_values) -> dict:
    """An ``as-release`` configuration's verdict with the fixes: run C with them against run C
    without them (what the release's own resume gives), per way of resuming; a world that failed
    in both modes with the same error is the release's own failure."""
    kept = {"unchanged": on["unchanged"]} if "unchanged" in on else {}
    if on_values is None or off_values is None:
        both = on_values is None and off_values is None and _same_error(cfg, on["error"], off["error"])
        shown = {k: on[k] for k in ("error", "detail") if k in on} or {
            "error": f"ran, where the release failed ({off['error']})"
        }
        return {**shown, "verdict": "as-release" if both else "differs", "same": "error" if both else None, **kept}
    if not cfg.resume_args:
        return {**same_as_release(cfg, on_values, off_values), **kept}
    ways = [
        {"args": list(args), **same_as_release(cfg, fixed, release)}
        for args, fixed, release in zip(cfg.resume_args, per_way(on_values), per_way(off_values))
    ]
    return {"verdict": _overall(ways), "ways": ways, **kept}


def needed_here(cfg) -> list:
    """The fixes of ``cfg.needs`` that this release needs (applied with default flags, and a release
    of ``cfg.needs_releases`` where the configuration says so)."""
    import mcore_ckpt_fixes

    if cfg.needs_releases:
        from packaging.specifiers import SpecifierSet

        from ..engine.version import detect

        version = detect().version
        if version is None or version not in SpecifierSet(cfg.needs_releases, prereleases=True):
            return []
    states = {row["id"]: row["state"] for row in mcore_ckpt_fixes.report()}
    return [f for f in cfg.needs if states.get(f) == "applied"]


def missing_requirement(cfg) -> str:
    """Why this installation cannot build ``cfg`` ('' if it can): a module it requires does not import."""
    if not cfg.requires:
        return ""
    import importlib

    try:
        importlib.import_module(cfg.requires)
    except ImportError as exc:
        return f"{cfg.requires} does not import here ({exc})"
    return ""


def check(cfg, device="cpu", modes=("on", "off"), timeout=240.0) -> dict:
    """One configuration's report: per mode its verdict and, per rank, what differs (per way of
    resuming, ``ways``, where the configuration lists several). Modes: ``on`` (every fix at its
    default; its ``unchanged`` entry: run B, which never resumes, against the release's own run A),
    ``off`` (every fix off), ``only`` (:data:`ONLY`: only ``cfg.needs`` on; the run C must be exact
    with them alone, so the fixes it needs are all it declares). For an :data:`AS_RELEASE`
    configuration ``on`` is run C with the fixes against run C without them: ``as-release`` or
    ``differs``; ``off`` stays the release's own resume against A."""
    out = {"config": cfg.name, "summary": cfg.summary, "world": cfg.world, "needs": list(cfg.needs)}
    out["expect"] = cfg.expect
    why = missing_requirement(cfg)
    if not why and cfg.pp > 1 and device == "cuda":
        why = "a pipeline layout's p2p sends run on gloo here, not yet tried on CUDA tensors: run it with --device cpu"
    if why:  # never a pass: the row says why it did not run
        out["not_applicable"] = why
        return out
    out.update({"needed_here": needed_here(cfg), "steps": STEPS, "resume_at": RESUME_AT})
    # The release's own run: what the import must not change, and what every resume must reach.
    uninterrupted, error, detail = run_phase(cfg, "uninterrupted", tempfile.gettempdir(), MODES["off"], device, timeout)
    if error:
        out.update({m: {"verdict": "error", "error": error, "detail": detail} for m in modes})
        return out
    # Which Adam the runs took (Megatron's FusedAdam path: Apex's, Transformer Engine's or the
    # stand-in; or torch's): a GPU record says which path each result used.
    out["optimizer"] = uninterrupted[0].get("optimizer")
    values = {}
    for mode in modes:
        out[mode], values[mode] = _mode(cfg, mode, uninterrupted, device, timeout)
    if cfg.expect == AS_RELEASE:
        if "off" not in modes:
            raise ValueError(f"{cfg.name} is held to the release's own resume: it needs the mode 'off'")
        out["on"] = _against_release(cfg, out["on"], values["on"], out["off"], values["off"])
    return out


def not_applicable() -> str:
    """Why this installation cannot run the check ('' if it can)."""
    try:
        import megatron.training.checkpointing  # noqa: F401
    except ImportError as exc:
        return (
            f"megatron.training does not import ({exc}): Megatron-Core wheels ship it from 0.17.0; "
            "older releases run it from a Megatron-LM checkout on PYTHONPATH"
        )
    return ""


# selftest --resume's default world: the configurations of up to this many ranks.
DEFAULT_NPROC = 2


def chosen(names=None, nproc=None) -> list:
    """The configurations to run: those named (every one, whatever its world, unless ``nproc`` is
    given too), else those of up to ``nproc`` ranks (default :data:`DEFAULT_NPROC`). Raises
    ValueError, one line, for an unknown name or a named configuration that needs more ranks."""
    if names is None:
        cap = DEFAULT_NPROC if nproc is None else nproc
        return [c for c in CONFIGS if c.world <= cap]
    known = {c.name: c for c in CONFIGS}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(
            f"unknown configuration {', '.join(map(repr, unknown)) or '(none given)'}; accepted: {', '.join(known)}"
        )
    too_big = [f"{n} ({known[n].world} ranks)" for n in names if nproc is not None and known[n].world > nproc]
    if too_big:
        raise ValueError(f"--nproc {nproc} is too few for {', '.join(too_big)}")
    return [c for c in CONFIGS if c.name in names]
