"""hybrid-optimizer-common-state's round trips, on 2 gloo ranks (DP=2), in one world:

* ``round_trip``: a one-layer bf16 GPT under Megatron's DDP and the distributed optimizer as
  Megatron-LM builds it with ``--optimizer-cpu-offload`` (:func:`mcore_ckpt_fixes.testing.offload.build_offloaded`),
  ``STEPS`` optimizer steps, saved with ``dist_checkpointing`` as ``fully_reshardable`` (0.14:
  ``fully_sharded_model_space``, its default); then one
  more step, the reference. A fresh target run (other initial values) loads the model and then the
  optimizer and takes the same next step. Compared on every rank: the model parameters, the hybrid
  optimizer's state per parameter (``exp_avg``, ``exp_avg_sq``, ``master_param``), the tensor each
  CPU optimizer updates and every step, after the load and after the next step. 0.14-0.18 keep the
  optimizer's param groups in ``common.pt``; 0.19 keeps its own common state in DCP.
* ``legacy_common_state``: the common state an older release's ``fully_reshardable`` save writes
  (the source optimizer's ``state_dict()`` in ``common.pt``, as 0.14-0.18 write it), read with
  ``dist_checkpointing.load_common_state_dict``: on 0.19 the path a checkpoint of 0.15-0.18 takes.
  Its param groups must come back equal.

What is not real on a CPU host: the hybrid optimizer's GPU, as :mod:`mcore_ckpt_fixes.testing.offload`
says (Megatron's optimizer modules see Apex's FusedAdam there, the path a GPU host takes).
"""

from __future__ import annotations

import os
import re
import shutil

import torch
import torch.distributed as dist

from ....testing.dist_optimizer import (
    SOURCE_SEED,
    distributed,
    placed,
    request,
    save_request,
    sharding_type,
    step,
    world,
)
from ....testing.dist_optimizer import prepare  # noqa: F401
from ....testing.offload import build_offloaded, offload_path, offloaded_state
from ....testing.result import RoundTrip, error_line
from ....testing.states import fix_states
from .. import ID, MODULE

STEPS = 2
TARGET_SEED = 4321


def checkpoint_format() -> str:
    """``fully_reshardable``, or on 0.14 (which has none) its default ``fully_sharded_model_space``,
    which keeps the param groups in ``common.pt`` too."""
    return sharding_type("fully_reshardable")


def refusal_line(exc) -> str:
    """torch's weights_only refusal (a page of advice) as the one class it refused."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    if type(exc).__name__ == "UnpicklingError" and found:
        return f"UnpicklingError: weights_only refuses {found.group(1)}"
    return error_line(exc)


def _steps(opt):
    return sorted({float(s["step"]) for d in distributed(opt) for s in d.optimizer.state.values() if "step" in s})


def _save(ckpt_dir, device):
    """The source run, saved: ``(path, its optimizer's state_dict(), saved state, reference)``."""
    model, opt = build_offloaded(SOURCE_SEED, device)
    for i in range(STEPS):
        step(model, opt, i)
    path = os.path.join(ckpt_dir, checkpoint_format())
    save_request(request(model, opt, checkpoint_format(), False), path)
    saved = offloaded_state(model, opt)
    state_dict = opt.state_dict()
    step(model, opt, STEPS)
    return path, state_dict, saved, offloaded_state(model, opt)


def _round_trip(rt, source, device):
    from megatron.core import dist_checkpointing

    path, _, saved, reference = source
    model, opt = build_offloaded(TARGET_SEED, device)
    rt.phase("load")
    loaded = dist_checkpointing.load(request(model, opt, checkpoint_format(), True), path)
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    rt["steps"] = _steps(opt)
    rt.compare(saved, offloaded_state(model, opt))
    rt.phase("next step")
    step(model, opt, STEPS)
    rt.compare(reference, offloaded_state(model, opt), prefix="next/")


def _legacy(rt, source, ckpt_dir):
    """``common.pt`` as 0.14-0.18 write it (this rank's own), read by the release's common-state load."""
    from megatron.core import dist_checkpointing

    state_dict = source[1]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in _param_groups(state_dict)]
    rt["classes"] = sorted({v.__name__ for g in groups for v in g.values() if isinstance(v, type)})
    path = os.path.join(ckpt_dir, f"legacy-rank{dist.get_rank()}")
    os.makedirs(path, exist_ok=True)
    # The checkpoint's own metadata.json (its format, which every release reads first) beside it.
    shutil.copy(os.path.join(source[0], "metadata.json"), path)
    torch.save({"optimizer": state_dict}, os.path.join(path, "common.pt"))
    rt.phase("load")
    loaded = dist_checkpointing.load_common_state_dict(path)
    got = [{k: v for k, v in g.items() if k != "params"} for g in _param_groups(loaded["optimizer"])]
    if got != groups:
        raise AssertionError(f"param groups read back: {got}, written: {groups}")
    rt.compare(_numbers(groups), _numbers(got))


def _numbers(groups) -> dict:
    """The param groups' numeric settings (lr, betas, ...) as tensors, for ``RoundTrip.compare``."""
    out = {}
    for i, group in enumerate(groups):
        for key, value in group.items():
            values = value if isinstance(value, (tuple, list)) else [value]
            if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                out[f"group{i}/{key}"] = torch.tensor([float(v) for v in values])
    return out


def _param_groups(state_dict):
    """The param groups of a distributed optimizer's ``state_dict()`` (one, or a chained optimizer's)."""
    inner = state_dict.get("optimizer", state_dict)
    if "param_groups" in inner:
        return inner["param_groups"]
    return [g for sub in state_dict.values() for g in _param_groups(sub)]


def cases(rank, world_size, ckpt_dir, patched, device="cpu"):
    """Both cases in one world: ``{case: result}``."""
    out = {}
    with world(device), offload_path() as mode:
        results = {
            name: RoundTrip(refusal_line, case=name, steps=STEPS) for name in ("round_trip", "legacy_common_state")
        }
        source = None
        with results["round_trip"].running() as rt:
            rt.phase("precondition")
            rt["fix_state"] = fix_states(ID, (MODULE,), patched)
            rt.phase("save")
            source = _save(ckpt_dir, mode)
            _round_trip(rt, source, mode)
        with results["legacy_common_state"].running() as rt:
            rt.phase("precondition")
            rt["fix_state"] = fix_states(ID, (MODULE,), patched)
            if source is None:
                raise AssertionError("the source run did not save")
            _legacy(rt, source, ckpt_dir)
        out = {name: placed(r.result) for name, r in results.items()}
    return out


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    """The selftest scenario: the legacy common state (every affected release reads one)."""
    return cases(rank, world_size, ckpt_dir, patched, device)["legacy_common_state"]
