"""rerun-state-strict-load's round trip, on 2 gloo ranks.

Save: a model shard per rank and the rerun state machine's entry as a machine in
``VALIDATE_RESULTS`` mode writes it with no rerun pending (the release's ``force=True`` state: what
0.18+ writes at every save, 0.12-0.13 always, and rerun-state-constant-structure on 0.14-0.17).

Load, under each ``--dist-ckpt-strictness`` value, as ``load_checkpoint`` builds the request: the
common state read first, the rerun entry asked for only where ``validate_state_dict`` accepts the
saved state (an idle one it rejects), so the request holds the model alone. Each value's outcome is
recorded (``"ok"`` or the error line; for ``return_*`` the keys it returned) and the model compared
exactly. Then a request that does ask for the entry (a pending rerun's load) under ``raise_all``.

Where the release ships ``megatron.training`` (0.17+), the same through ``save_checkpoint`` and
``load_checkpoint`` with ``args.dist_ckpt_strictness = "raise_all"``: the resume check's small GPT
after one real training step, the process's rerun machine in ``VALIDATE_RESULTS`` mode (as
``initialize_megatron`` sets it up), loaded into a new model. On 0.17 the checkpoint has the entry
when rerun-state-constant-structure is on, as it is by default.

The first strictness value that fails is raised at the end of phase ``load``, so a world shows the
bug as one error; every value's outcome stays in ``outcomes``.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from ....testing import placement
from ....testing.gpt_job import training_checkpointing
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from ...rerun_state_constant_structure.checks.core import entry_state, forced_entry, megatron_groups
from .. import ID, MODULE, RERUN_KEY

STRICTNESS = (
    "assume_ok_unexpected",
    "log_unexpected",
    "log_all",
    "raise_unexpected",
    "raise_all",
    "return_unexpected",
    "return_all",
    "ignore_all",
)


def prepare() -> None:
    """In the parent of a forked world: the modules the ranks use."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401
    import megatron.core.dist_checkpointing.validation  # noqa: F401
    import megatron.core.rerun_state_machine  # noqa: F401

    if training_checkpointing() is not None:
        from megatron.core.models.gpt import GPTModel  # noqa: F401
        from megatron.core.optimizer import get_megatron_optimizer  # noqa: F401


@contextlib.contextmanager
def _machine():
    """The process-wide machine in VALIDATE_RESULTS mode, as initialize_megatron sets it up."""
    from megatron.core import rerun_state_machine as rsm

    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.VALIDATE_RESULTS)
    try:
        yield rsm.get_rerun_state_machine()
    finally:
        rsm.destroy_rerun_state_machine()


def _model(rank, seed):
    from megatron.core.dist_checkpointing import ShardedTensor

    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed + rank)).to(placement.device())
    return w, {"w": ShardedTensor.from_rank_offsets("model.w", w, (0, rank, dist.get_world_size()))}


def _request(path, machine, model_sd):
    """The load request as load_checkpoint builds it."""
    from megatron.core import dist_checkpointing

    request = {"model": model_sd}
    common = dist_checkpointing.load_common_state_dict(path)
    if "rerun_state_machine" in common and _asks_for_entry(machine, common["rerun_state_machine"]):
        request["rerun_state_machine"] = forced_entry(machine)
    return request


def _asks_for_entry(machine, entry):
    """From 0.14 load_checkpoint asks for the entry where ``validate_state_dict`` accepts it (a
    rerun to restore), so an idle entry is left out at any topology. 0.12-0.13 ask for it whenever
    it is there, except with --finetune or on another topology: there the round trip loads as
    those do, the loads that leave it out."""
    validate = getattr(machine, "validate_state_dict", None)
    return False if validate is None else bool(validate(entry))


def _load_each(rt, path, machine, rank, saved):
    """Every strictness value's outcome; the first failure, if any, is returned to be raised."""
    from megatron.core import dist_checkpointing

    outcomes, first = {}, None
    for strict in STRICTNESS:
        model_sd = _model(rank, 100)[1]
        try:
            out = dist_checkpointing.load(_request(path, machine, model_sd), path, strict=strict)
        except BaseException as exc:  # CheckpointException derives from BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            outcomes[strict] = error_line(exc)
            first = first or exc
            continue
        if isinstance(out, tuple):  # return_*: (state, missing, unexpected)
            out, missing, unexpected = out
            outcomes[strict] = {"missing": sorted(missing), "unexpected": sorted(unexpected)}
        else:
            outcomes[strict] = "ok"
        rt.compare({f"{strict}/w": saved}, {f"{strict}/w": out["model"]["w"]}, prefix="model/")
    rt["outcomes"] = outcomes
    return first


def _pending_rerun_load(rt, path, machine, rank, saved):
    """A load that asks for the entry (as for a pending rerun) under raise_all: as the release."""
    from megatron.core import dist_checkpointing

    request = {"model": _model(rank, 200)[1], "rerun_state_machine": forced_entry(machine)}
    out = dist_checkpointing.load(request, path, strict="raise_all")
    rt["pending_rerun_state"] = entry_state(out["rerun_state_machine"]).name
    rt.compare({"asked/w": saved}, {"asked/w": out["model"]["w"]}, prefix="model/")


def _through_dist_checkpointing(rt, ckpt_dir, rank):
    from megatron.core import dist_checkpointing

    path = os.path.join(ckpt_dir, "iter_1")
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    w, model_sd = _model(rank, 1)
    with megatron_groups(), _machine() as machine:
        dist_checkpointing.save({"model": model_sd, "rerun_state_machine": forced_entry(machine)}, path)
        rt.phase("load")
        first = _load_each(rt, path, machine, rank, w)
        _pending_rerun_load(rt, path, machine, rank, w)
    return first


def _through_megatron_training(rt, training, ckpt_dir):
    """save_checkpoint after a real step, load_checkpoint with raise_all into a new model."""
    from megatron.core import parallel_state as mpu

    from ....testing import gpt_job as job
    from ....testing.job_config import Config

    cfg = Config("dense-dp2", "dense GPT, DP=2", world=2)
    with job.worker(cfg, placement.current()) as cpu_gen, _machine():
        args = job.parse_args(cfg, os.path.join(ckpt_dir, "training"), 2)  # warm-up 1 < decay
        mpu.initialize_model_parallel()
        job.seed(args)
        model, optimizer, scheduler = job.build(args, cfg)
        job.train_step(model, optimizer, scheduler, args, cpu_gen)
        training.save_checkpoint(1, [model], optimizer, scheduler, 0)
        saved = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        dist.barrier()
        path = training.get_checkpoint_name(args.save, 1, return_base_dir=True)
        rt["training_entry_on_disk"] = _has_entry(path)
        rt.phase("load")
        args.dist_ckpt_strictness = "raise_all"
        model, optimizer, scheduler = job.build(args, cfg)
        rt["iteration"] = training.load_checkpoint([model], optimizer, scheduler)[0]
        rt.compare(saved, {n: p.detach().clone() for n, p in model.module.named_parameters()}, prefix="gpt/")


def _has_entry(path):
    from torch.distributed.checkpoint import FileSystemReader

    return any(k.startswith(RERUN_KEY) for k in FileSystemReader(path).read_metadata().state_dict_metadata)


def error_line(exc):
    """``Type: message`` on one line (the validation's message spans two)."""
    return f"{type(exc).__name__}: {' '.join(part.strip() for part in str(exc).splitlines()).strip()}"


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    from ....testing._cpu_shims import cuda_to_cpu_mode

    rt = RoundTrip(error_line=error_line)
    training = training_checkpointing()
    rt["through"] = "megatron.training" if training is not None else "dist_checkpointing"
    on_cpu = device == "cpu" and not torch.cuda.is_available()
    with placement.on(device), rt.running():
        rt["device"] = str(placement.device())
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt.phase("save")
        # The machine all-reduces its requests in tensors made with device="cuda".
        with cuda_to_cpu_mode() if on_cpu else contextlib.nullcontext():
            first = _through_dist_checkpointing(rt, ckpt_dir, rank)
        if training is not None:
            rt.phase("save")
            try:
                _through_megatron_training(rt, training, ckpt_dir)
                rt["training_load"] = "ok"
            except BaseException as exc:
                if first is None or isinstance(exc, KeyboardInterrupt):
                    raise
                rt["training_load"] = f"{rt.current_phase}: {error_line(exc)}"
        if first is not None:
            rt.phase("load")
            raise first
    return rt.result
