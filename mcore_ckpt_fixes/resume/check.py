"""Run the resume check: uninterrupted (A), saving and going on (B), resumed in new processes (C).

Per configuration (:mod:`.configs`): run A is the release's own run, every fix off
(``MCORE_CKPT_FIXES=off``), ``steps`` steps, no checkpoint; run B trains ``resume_at`` steps, saves
through ``save_checkpoint`` and trains on to ``steps``, as a training run does; run C is a new world
of new processes that builds the same job, ``load_checkpoint`` s and trains the remaining steps.
Compared per rank, bit for bit (:mod:`.compare`): C with A (the resume is exact), and B with the
fixes on with A over every step (``unchanged``: a run that never resumes is the same with the import
as without it, its saves included). B and C run twice: with the fixes at their defaults and with
every fix off, so that the report says what the fixes change on this release; on request a third
time with only the fixes the configuration declares it needs (``only``).
"""

from __future__ import annotations

import shutil
import tempfile

from ..testing.launcher import run_world
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


def prepare() -> None:
    """Import in the parent what every rank uses, once (forked ranks then start warm)."""
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.training.arguments  # noqa: F401
    import megatron.training.checkpointing  # noqa: F401
    import megatron.training.initialize  # noqa: F401
    import megatron.training.training  # noqa: F401

    from ..fixes.mimo_optimizer.checks.core import prepare as prepare_mimo
    from .bridge import prepare as prepare_bridge
    from .ms_swift import prepare as prepare_ms_swift
    from .verl import prepare as prepare_verl

    prepare_mimo()
    prepare_bridge()
    prepare_verl()
    prepare_ms_swift()


def _peer_lost(error) -> bool:
    last = (error or "").strip().splitlines()[-1:]
    return bool(last) and ("Connection closed by peer" in last[0] or "Connection reset by peer" in last[0])


def _world(cfg, phase, ckpt_dir, env, device, timeout):
    kwargs = dict(cfg=cfg, phase=phase, ckpt_dir=ckpt_dir, steps=STEPS, resume_at=RESUME_AT, device=device)
    # CUDA state does not survive a fork: on a GPU the ranks are fresh interpreters (gloo still,
    # so that several ranks may share one GPU).
    method = "spawn" if device == "cuda" else "fork"
    results = run_world(cfg.job, cfg.world, kwargs, timeout=timeout, env=env, backend="gloo", method=method)
    # A rank whose peer failed reports the lost connection; the peer's own error is the cause.
    failed = sorted((r for r in results if not r.ok), key=lambda r: _peer_lost(r.error))
    if failed:
        last = (failed[0].error or "").strip().splitlines()
        return None, f"{phase} run: rank {failed[0].rank}: {last[-1] if last else 'failed'}", failed[0].error
    return [r.value for r in results], None, None


def _verdict(uninterrupted, values) -> dict:
    from .compare import rank_verdict

    ranks = [rank_verdict(a, c) for a, c in zip(uninterrupted, values)]
    return {"verdict": "exact" if all(r["exact"] for r in ranks) else "inexact", "ranks": ranks}


def _mode(cfg, mode, uninterrupted, device, timeout):
    """B then C with this mode's flags, C compared with A; with the fixes on also B with A
    (``unchanged``)."""
    ckpt_dir = tempfile.mkdtemp(prefix=f"mcore-ckpt-fixes-resume-{cfg.name}-{mode}-")
    out = {}
    try:
        for phase in ("save", "resume"):
            values, error, detail = _world(cfg, phase, ckpt_dir, mode_env(cfg, mode), device, timeout)
            if error:
                return {"verdict": "error", "error": error, "detail": detail, **out}
            if phase == "save" and mode == "on":
                out["unchanged"] = _verdict(uninterrupted, values)
        return {**_verdict(uninterrupted, values), **out}
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)


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
    """One configuration's report: per mode its verdict and, per rank, what differs. Modes: ``on``
    (every fix at its default; its ``unchanged`` entry: run B, which never resumes, against the
    release's own run A), ``off`` (every fix off), ``only`` (:data:`ONLY`: only ``cfg.needs`` on; the
    run C must be exact with them alone, so the fixes it needs are all it declares)."""
    out = {"config": cfg.name, "summary": cfg.summary, "world": cfg.world, "needs": list(cfg.needs)}
    why = missing_requirement(cfg)
    if why:  # never a pass: the row says why it did not run
        out["not_applicable"] = why
        return out
    out.update({"needed_here": needed_here(cfg), "steps": STEPS, "resume_at": RESUME_AT})
    # The release's own run: what the import must not change, and what every resume must reach.
    uninterrupted, error, detail = _world(cfg, "uninterrupted", tempfile.gettempdir(), MODES["off"], device, timeout)
    if error:
        out.update({m: {"verdict": "error", "error": error, "detail": detail} for m in modes})
        return out
    for mode in modes:
        out[mode] = _mode(cfg, mode, uninterrupted, device, timeout)
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


def chosen(names=None, nproc=None) -> list:
    return [c for c in CONFIGS if (names is None or c.name in names) and (nproc is None or c.world == nproc)]
