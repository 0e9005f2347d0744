"""fused-adam-group-step's round trip on 2 gloo ranks (DP=2): Megatron's DDP and distributed
optimizer on the FusedAdam path (Apex's FusedAdam stood in on a host without Apex or Transformer
Engine: testing/_fused_adam.py, a step per param group, empty groups skipped, as both keep it).

The model is a one-layer GPT whose untied output layer has 1024 rows and whose word embedding is
frozen: DP rank 0's shard of the gradient buffer (which starts at the model's last parameter) holds
output-layer rows only, so the no-weight-decay group (norms, biases) is empty there and holds
parameters on rank 1, as on many ranks of a large-vocabulary model.

The old run trains ``STEPS`` steps and saves ``dp_zero_gather_scatter`` with a release <= 0.13
(whose writer keeps FusedAdam's groups as DP rank 0 has them), then trains ``MORE`` steps: the
uninterrupted run, kept per rank. On 0.12-0.13 that is this release, in this world. On 0.14+ the
tests run a 0.13.1 world (:func:`write_old_checkpoint`) and hand its checkpoint and kept state in as
``old``; selftest, which has no such release, lets this release write it with the param groups
stood in as 0.13 writes them (:func:`as_saved_before_014`). The resumed run loads, trains ``MORE`` steps, saves (where 0.14+ stops without the fix),
compares every non-empty group's step and every parameter, main-parameter shard and Adam moment
with the uninterrupted run's, and a next run loads that save.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ....testing import _fused_adam
from ....testing import dist_optimizer as dopt
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from ....testing.world_errors import WorldFailed, shared
from .. import ID, MODULE

SHAPE = dopt.Shape(hidden_size=32, vocab_size=1024, frozen=("embedding.word_embeddings.weight",))
STEPS, MORE = 5, 3
OLD_FORMAT = "dp_zero_gather_scatter"  # what releases <= 0.13 save and 0.14-0.19.2 still read
AVOID_PREFIX = {"chained_optim_avoid_prefix": True}  # what megatron.training asks from 0.14 on
NOT_EXACT = "the resumed run differs from the uninterrupted run (a group's step, and so its Adam update)"


def prepare() -> None:
    """In the parent of a forked world: the modules the ranks use."""
    dopt.prepare()


def writes_step_less_groups() -> bool:
    """Releases <= 0.13 save FusedAdam's groups as they are; 0.14 added to
    ``DistributedOptimizer.state_dict`` the alignment of every saved group's step."""
    import megatron.core
    from packaging.version import Version

    return Version(megatron.core.__version__) < Version("0.14.0")


def group_steps(opt) -> list:
    """Each non-empty param group's step, per distributed optimizer (None: no step yet)."""
    return [[g.get("step") for g in d.optimizer.param_groups if g["params"]] for d in dopt.distributed(opt)]


def _metadata():
    return {} if writes_step_less_groups() else AVOID_PREFIX


def as_saved_before_014(state, opt):
    """A 0.14+ save request of ``opt`` with its param groups as releases <= 0.13 write them, for a
    selftest on a release that cannot write them itself (the tests use a real 0.13.1 world): those
    save FusedAdam's groups as it holds them, so a group that never stepped on this rank has no step,
    where 0.14+ give it the other groups' step. Nothing else of the request changes."""
    (optimizer,) = dopt.distributed(opt)  # one distributed optimizer: its groups, in saved order
    live = optimizer.optimizer.param_groups
    for saved in _saved_group_lists(state):
        assert len(saved) == len(live), (len(saved), len(live))
        for group, held in zip(saved, live):
            if "step" not in held:
                group.pop("step", None)
    return state


def _saved_group_lists(tree):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if isinstance(tree, ShardedObject):
        tree = tree.data
    if isinstance(tree, dict):
        if isinstance(tree.get("param_groups"), list):
            yield tree["param_groups"]
        for value in tree.values():
            if isinstance(value, (dict, ShardedObject)):
                yield from _saved_group_lists(value)


def _uninterrupted(folder, rank):
    """Train, save ``OLD_FORMAT`` into ``folder``/checkpoint, train on: what the run kept, also in
    ``folder``/kept-rank<N>.pt. Releases <= 0.13 write the checkpoint as users have it; later ones
    with those groups stood in."""
    model, opt = dopt.build(dopt.SOURCE_SEED, shape=SHAPE)
    for i in range(STEPS):
        dopt.step(model, opt, i)
    state = dopt.request(model, opt, OLD_FORMAT, False, **_metadata())
    if not writes_step_less_groups():
        state = as_saved_before_014(state, opt)
    dopt.save_request(state, os.path.join(folder, "checkpoint"))
    for i in range(STEPS, STEPS + MORE):
        dopt.step(model, opt, i)
    kept = {"state": dopt.local_state(model, opt), "steps": group_steps(opt)}
    torch.save(kept, os.path.join(folder, f"kept-rank{rank}.pt"))
    return kept


def write_old_checkpoint(rank, world_size, ckpt_dir, device="cpu"):
    """On a release <= 0.13: the old run, its checkpoint and what it kept (``kept-rank<N>.pt``)."""
    assert writes_step_less_groups(), "the old checkpoint is written by a release <= 0.13"
    with dopt.world(device), _fused_adam.optimizer_path(apex=True):
        return {"steps": _uninterrupted(ckpt_dir, rank)["steps"]}


def _writer():
    if writes_step_less_groups():
        return "this release"
    return "this release, its saved param groups as releases <= 0.13 write them (as_saved_before_014)"


def _load(model, opt, path, fmt):
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(dopt.request(model, opt, fmt, True, **_metadata()), path)
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])


def _exact(differs):
    if differs:
        raise AssertionError(NOT_EXACT)


def _resume(rt, old, ckpt_dir, rank):
    rt.phase("load")
    model, opt = dopt.build(4321, shape=SHAPE)
    _load(model, opt, os.path.join(old, "checkpoint"), OLD_FORMAT)
    rt["loaded_steps"] = group_steps(opt)
    for i in range(STEPS, STEPS + MORE):
        dopt.step(model, opt, i)
    rt["steps"] = group_steps(opt)
    fmt, path = dopt.sharding_type("dp_reshardable"), os.path.join(ckpt_dir, "resumed")
    state = shared("save", dopt.request, model, opt, fmt, False, **_metadata())
    shared("save", dopt.save_request, state, path)
    kept = torch.load(os.path.join(old, f"kept-rank{rank}.pt"), weights_only=True)
    rt["reference_steps"] = kept["steps"]
    differ = rt.compare(kept["state"], dopt.local_state(model, opt))
    # Judged on every rank at once: rank 0, where the group is empty, is exact either way.
    shared("compare", _exact, bool(differ) or rt["steps"] != kept["steps"])
    rt.phase("reload")
    model, opt = dopt.build(999, shape=SHAPE)
    _load(model, opt, path, fmt)
    rt["reloaded_steps"] = group_steps(opt)


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu", old=None):
    rt = RoundTrip(steps=None, reference_steps=None, loaded_steps=None, reloaded_steps=None, rank_errors=None)
    with rt.running(), dopt.world(device), _fused_adam.optimizer_path(apex=True):
        rt["device"] = str(dopt.device())
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt["old_writer"] = "a test's 0.13.1 world" if old else _writer()
        if old is None:
            rt.phase("save")
            old = os.path.join(ckpt_dir, "old")
            _uninterrupted(old, rank)
            dist.barrier()
        try:
            _resume(rt, old, ckpt_dir, rank)
        except WorldFailed as failed:
            rt["rank_errors"] = failed.rank_errors
            rt.fail(failed.error, failed.phase)
    return dopt.placed(rt.result)
