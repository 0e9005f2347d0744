"""dp-reshardable-padding's round trips: Megatron's DDP and distributed optimizer
(:mod:`mcore_ckpt_fixes.testing.dist_optimizer`) on a one-layer GPT, saved in ``dp_reshardable``
format (Megatron-LM's default) with ``dist_checkpointing`` on 2 gloo ranks (DP=2), on the optimizer
path users train on (Apex FusedAdam's interface, the CPU stand-in of
:mod:`mcore_ckpt_fixes.testing._fused_adam`). The word embedding is marked as Megatron marks a tied
embedding on a pipeline stage (``shared_embedding``): DDP gives it a bucket of its own and closes
the bucket before it at the embedding's 64-aligned start. Building that from a real PP=2 x DP=2 run
takes 4 ranks; the buffer's layout reads nothing of the pipeline but that mark.

* ``all_padding_shard`` (#6191): ``--ddp-pad-buckets-for-high-nccl-busbw`` pads each bucket to 65536
  elements; the embedding's bucket (4096) leaves rank 1's half all padding, while rank 1 holds
  parameters of the other bucket. Without the fix rank 1 stops building the request with
  ``AssertionError: empty bucket encountered``.
* ``past_unpadded_end`` (#5898): hidden size 40 and 9 positions: the bucket before the embedding
  ends at 22952, its unpadded size is 22976 and it is padded to 23040, so rank 1's shard (from 11520)
  runs 64 elements past the checkpoint tensor. Without the fix torch DCP rejects the global plan on
  rank 0 (``ValueError: Failed to validate global plan``) after rank 1 wrote its file: no metadata is
  written (``metadata_written``), what is left is recorded (``left_on_disk``).
* ``release_layout``: hidden size 40 and 7 positions: the bucket ends on a multiple of the shard
  size, which the release handles: both halves save the same pieces (``layout``) and round-trip.

A source run takes ``STEPS`` steps and saves; one more step is the reference. A target (other initial
values) builds Megatron's own load request, loads and takes the same next step. Compared per
parameter, whole (each rank's shard in place, summed over the ranks): fp32 main value and Adam moments
after the load equal the source's at the save (``max_delta``), and after one more step the
uninterrupted run's (``next/``).

Every rank reports the world's first failure (``error``, ``phase``; ``rank_errors``: each rank's own):
a request a rank cannot build is shared before the save's collectives start; a save that fails on
one rank inside DCP's collectives leaves the others waiting, and they learn its error from its
``failed.rank<N>`` file in the case's directory once its process has gone. So a world runs
``past_unpadded_end`` last: without the fix it ends the world.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from ....testing._fused_adam import optimizer_path
from ....testing.dist_optimizer import Shape, build, full_state, placed, request, step, world
from ....testing.dist_optimizer import prepare  # noqa: F401  (the scenarios' prepare)
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from ....testing.world_errors import WorldFailed, shared, through_files
from .. import ID, MODULE

STEPS = 2
SOURCE_SEED, TARGET_SEED = 1234, 98765
FORMAT = "dp_reshardable"
PLAN_REJECTED = "ValueError: Failed to validate global plan"
METADATA = (".metadata", "metadata.json")  # torch DCP's, Megatron's


@dataclass(frozen=True)
class Case:
    shape: Shape
    doc: str


CASES = {
    "release_layout": Case(Shape(hidden_size=40, positions=7, shared_embedding=True), "the release's pieces are right"),
    "all_padding_shard": Case(
        Shape(shared_embedding=True, pad_buckets_for_high_nccl_busbw=True), "rank 1's half of a bucket all padding"
    ),
    "rank_without_parameters": Case(
        Shape(hidden_size=40, positions=9, shared_embedding=True, pad_buckets_for_high_nccl_busbw=True),
        "every bucket under 32768 elements: rank 1 holds no parameter at all; rank 0's shard of the "
        "first runs past its unpadded size",
    ),
    "past_unpadded_end": Case(
        Shape(hidden_size=40, positions=9, shared_embedding=True), "rank 1's shard ends past the unpadded size"
    ),
}


def error_line(exc) -> str:
    """One line per failure: a failure another rank had (:class:`WorldFailed`) as that rank said it;
    DCP's plan rejection without the pieces it lists (they name every key)."""
    if isinstance(exc, WorldFailed):
        return exc.error
    line = f"{type(exc).__name__}: {exc}"
    return PLAN_REJECTED if line.startswith(PLAN_REJECTED) else line


def _before_collectives(rt, phase, fn):
    """``fn()`` on every rank, whose failure on any rank ends the case on every rank."""
    rt.phase(phase)
    return shared(phase, fn, line=error_line)


def _inside_collectives(rt, phase, fn, case_dir):
    """``fn()``, a step whose failure on one rank can leave the others waiting in a collective until
    that rank's process ends: the world's first failure is shared through files."""
    rt.phase(phase)
    return through_files(phase, fn, case_dir, line=error_line)


def _layout(optimizer_sd):
    """This rank's pieces of the optimizer's bucket tensors: (key, offset, length, global length)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return sorted(
        (v.key, v.global_offset[0], v.local_shape[0], v.global_shape[0])
        for v in nested_values(optimizer_sd)
        if isinstance(v, ShardedTensor) and ".bucket_idx_" in v.key
    )


def _buckets(model):
    """Per bucket of the gradient buffer: (unpadded size, padded size)."""
    return [(b.numel_unpadded, b.grad_data.numel()) for buffer in model.buffers for b in buffer.buckets]


def run_case(name, ckpt_dir, patched):
    """One case (``CASES``) in a world whose parallel state is initialised: its RoundTrip result."""
    from megatron.core import dist_checkpointing

    case = CASES[name]
    rt = RoundTrip(error_line=error_line, case=name, rank_errors=None)
    case_dir = os.path.join(ckpt_dir, name)
    with rt.running(), optimizer_path(apex=True):
        try:
            rt.phase("precondition")
            rt["fix_state"] = fix_states(ID, (MODULE,), patched)
            model, opt = build(SOURCE_SEED, shape=case.shape)
            rt["buckets"] = _buckets(model)
            for i in range(STEPS):
                step(model, opt, i)
            saving = _before_collectives(rt, "request", lambda: request(model, opt, FORMAT, False))
            rt["layout"] = _layout(saving["optimizer"])
            if dist.get_rank() == 0:
                os.makedirs(case_dir, exist_ok=True)
            dist.barrier()
            try:
                _inside_collectives(rt, "save", lambda: dist_checkpointing.save(saving, case_dir), case_dir)
            except WorldFailed:
                # The coordinator (rank 0) writes the metadata last: a save it failed has none.
                rt["metadata_written"] = any(os.path.exists(os.path.join(case_dir, n)) for n in METADATA)
                rt["left_on_disk"] = sorted(n for n in os.listdir(case_dir) if not n.startswith("failed.rank"))
                raise
            saved = full_state(model, opt)
            step(model, opt, STEPS)
            reference = full_state(model, opt)
            target, target_opt = build(TARGET_SEED, shape=case.shape)
            loading = _before_collectives(rt, "request", lambda: request(target, target_opt, FORMAT, True))
            rt.phase("load")
            loaded = dist_checkpointing.load(loading, case_dir)
            target.module.load_state_dict(loaded["model"])
            target_opt.load_state_dict(loaded["optimizer"])
            rt.compare(saved, full_state(target, target_opt))
            step(target, target_opt, STEPS)
            rt.compare(reference, full_state(target, target_opt), prefix="next/")
        except WorldFailed as failed:
            rt["rank_errors"] = failed.rank_errors
            if failed.traceback:
                rt["rank_traceback"] = failed.traceback
            rt.record(failed, phase=failed.phase)
            rt["raw_error"] = failed.error
    return rt.result


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """Several cases in one world, in ``CASES`` order (``past_unpadded_end`` last: without the fix
    it ends the world): ``{case: result}``."""
    names = [n for n in CASES if n in (names or CASES)]
    with world(device):
        return {name: placed(run_case(name, ckpt_dir, patched)) for name in names}


def _one(name):
    def scenario(rank, world_size, ckpt_dir, patched, device="cpu"):
        with world(device):
            return placed(run_case(name, ckpt_dir, patched))

    scenario.__name__ = scenario.__qualname__ = name
    return scenario


all_padding_shard = _one("all_padding_shard")
past_unpadded_end = _one("past_unpadded_end")
