"""One rank of a job as a user runs it, with every line the package logs and every warning it gives
kept: run in fresh interpreters (spawn), so that Megatron is imported, and the fixes applied, after
the records are being kept."""

import importlib
import logging
import sys
import warnings


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append((record.levelname, record.getMessage()))


def _ours(caught):
    return [str(w.message) for w in caught if w.category.__name__ == "MegatronPatchWarning"]


def import_then_load(rank, world_size, ckpt_dir=None):
    """``start``: the package's log records and warnings while every target module is imported (the
    fixes applied); ``load``: the same during rng-under-ep's ``load_checkpoint`` of ``ckpt_dir``."""
    megatron_before = sorted(m for m in sys.modules if m.split(".")[0] == "megatron")
    keep = _Keep()
    log = logging.getLogger("mcore_ckpt_fixes")
    log.addHandler(keep)
    log.setLevel(logging.DEBUG)  # every record is kept; the levels say who would see it
    from mcore_ckpt_fixes.engine.registry import ENGINE

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _, module in ENGINE.enabled_target_modules(installed_only=True):
            try:
                importlib.import_module(module)
            except ImportError:
                pass  # not in this release (or needs a CUDA-only package): as in a user's job
    result = {"megatron_before": megatron_before, "start": list(keep.records), "start_warnings": _ours(caught)}
    del keep.records[:]
    if ckpt_dir is not None:
        from mcore_ckpt_fixes.fixes.rng_under_ep.checks.core import load_only

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rt = load_only(rank, world_size, ckpt_dir, patched=True)
        # load_checkpoint's own warnings are kept by the round trip (rt["warnings"]); any other of ours here.
        result.update(load=list(keep.records), load_warnings=rt["warnings"] + _ours(caught), round_trip=rt)
    return result
