"""rerun-state-constant-structure's round trip, on 2 gloo ranks.

The real ``RerunStateMachine`` (the process singleton, as Megatron-LM's training loop uses it) in
``VALIDATE_RESULTS`` mode with its own error injector (``error_injection_rate=1``,
``PERSISTENT_ERROR``: every validated result from the second step on is rejected and reproduces in
place), a ``RerunDataIterator`` over the batch numbers, and a loop that drives it as
``train_step`` does (``should_run_forward_backward`` / ``validate_result`` /
``should_checkpoint_and_exit``). Step 1 ends normally and is saved (the steady-state save that
caches the plan); step 2 ends with the machine asking for a checkpoint and exit
(``WILL_RERUN_FROM_CHECKPOINT``) and is saved through the same cached plan. A new machine then loads
and runs the step again.

Where the release ships ``megatron.training`` (0.17+): the resume check's small GPT
(:mod:`mcore_ckpt_fixes.testing.gpt_job`: Megatron's arguments with ``--ckpt-assume-constant-structure``,
model, DDP, distributed optimizer, one real training step), saved with
``megatron.training.checkpointing.save_checkpoint`` (one ``checkpointing_context`` for both saves,
``train_data_iterator`` the machine's iterator) and loaded with ``load_checkpoint`` into a new model.
Before 0.17 its calls are made here as it makes them: one ``TorchDistSaveShardedStrategy`` with
``use_cached_ckpt_structure`` and ``thread_count=1`` kept for every save, sharding validation only
on the first, ``rerun_state_machine`` in the state dict only when the machine's
``state_dict(data_iterator, "torch_dist")`` returns one, and a rank's model shard; the load reads the
common state first, asks for the ``force=True`` template only where ``validate_state_dict`` accepts
it, and calls ``load_state_dict``.

Checked on every rank (phase ``rerun-state``): the machine after the load has what it had at the
fault-time save (state, requests, failed call, initial result, suspicious node and device, the data
iterator's replay buffers), and the resumed step is the rerun from checkpoint (the machine
recognises the same node and device and asks to restart again, ``EXIT_CODE_RESUME_TO_DISAMBIGUATE``).
With the fix on, both checkpoints are also loaded with the release's own ``state_dict`` building the
request (the fix changes no load request).
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
from .. import ID, MODULE

FIELDS = (
    "state",
    "current_iteration",
    "rerun_requested",
    "checkpoint_requested",
    "restart_again_requested",
    "continue_requested",
    "failed_validation_call",
    "initial_result",
    "suspicious_node",
    "suspicious_device",
)


def prepare() -> None:
    """In the parent of a forked world: the modules the ranks use (the checkpoint writer's among
    them, so that the worker gives its results queue a forked manager, not a spawned one)."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401
    import megatron.core.rerun_state_machine  # noqa: F401

    if training_checkpointing() is not None:
        from megatron.core.models.gpt import GPTModel  # noqa: F401
        from megatron.core.optimizer import get_megatron_optimizer  # noqa: F401


@contextlib.contextmanager
def megatron_groups():
    """Megatron's process groups (one data-parallel group of every rank) as initialize_megatron
    sets them up before the machine: before 0.14 the machine's state_dict reads the pipeline rank."""
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel()
    try:
        yield
    finally:
        mpu.destroy_model_parallel()


@contextlib.contextmanager
def fresh_machine(error="PERSISTENT_ERROR"):
    """A fresh process-wide machine in VALIDATE_RESULTS mode, injecting an error of the
    ``RerunDiagnostic`` named ``error`` into every validated result from the second step on."""
    from megatron.core import rerun_state_machine as rsm

    rsm.initialize_rerun_state_machine(
        mode=rsm.RerunMode.VALIDATE_RESULTS,
        error_injector=rsm.RerunErrorInjector(error_injection_rate=1, error_injection_type=rsm.RerunDiagnostic[error]),
    )
    try:
        yield rsm.get_rerun_state_machine(), rsm.RerunDataIterator(iter(range(1000)))
    finally:
        rsm.destroy_rerun_state_machine()


def drive_step(machine, data):
    """One training step as train_step drives the machine: (should_checkpoint, should_exit, code)."""
    while machine.should_run_forward_backward(data):
        loss = torch.tensor(float(next(data)))
        machine.validate_result(result=loss, rejection_func=torch.isnan, message="loss is NaN")
    return machine.should_checkpoint_and_exit()


def model_shard(rank, seed):
    from megatron.core.dist_checkpointing import ShardedTensor

    g = torch.Generator().manual_seed(seed + rank)
    w = torch.randn(4, 3, generator=g).to(placement.device())
    return w, {"w": ShardedTensor.from_rank_offsets("model.w", w, (0, rank, dist.get_world_size()))}


def save_with_rerun_state(path, strategy, first, model_sd, machine, data):
    from megatron.core import dist_checkpointing

    state = {"model": model_sd}
    rerun = machine.state_dict(data_iterator=data, ckpt_format="torch_dist")
    if rerun:  # generate_state_dict adds the entry only then
        state["rerun_state_machine"] = rerun
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, path, strategy, validate_access_integrity=first)


def cached_save_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    strategy.use_cached_ckpt_structure = True
    strategy.thread_count = 1
    return strategy


def restores_rerun(machine, entry) -> bool:
    """Whether load_checkpoint asks for the saved rerun entry at the saved topology without
    --finetune: from 0.14 where ``validate_state_dict`` accepts it (a rerun to restore); 0.12-0.13
    have no such check and ask whenever the entry is there."""
    validate = getattr(machine, "validate_state_dict", None)
    return True if validate is None else bool(validate(entry))


def forced_entry(machine, build=None):
    """The machine's full entry whatever its state (what a load fills in): ``force=True`` from 0.14;
    before, the state is always returned. ``build``: the ``state_dict`` function (default: the
    machine's own)."""
    build = build or type(machine).state_dict
    try:
        return build(machine, None, "torch_dist", force=True)
    except TypeError:  # 0.12-0.13: no force
        return build(machine, None, "torch_dist")


def load_with_rerun_state(path, model_sd, machine, state_dict=None):
    """As ``load_checkpoint`` reads the rerun state: the common state first, the machine's
    ``force=True`` template only where ``validate_state_dict`` accepts what was saved.
    ``state_dict``: the function that builds the template (default: the machine's own)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(path)
    request = {} if model_sd is None else {"model": model_sd}
    if "rerun_state_machine" in common and restores_rerun(machine, common["rerun_state_machine"]):
        request["rerun_state_machine"] = forced_entry(machine, state_dict)
    loaded = dist_checkpointing.load(request, path)
    if "rerun_state_machine" in request:  # else load_checkpoint keeps ignore_rerun_state
        machine.load_state_dict(loaded["rerun_state_machine"])
    return loaded


def entry_state(entry):
    """The machine's state in a rerun entry: at its top from 0.14 on, among the sharded fields
    before (0.12-0.13 keep it with them, in the ShardedObject); None where the entry has none."""
    if "state" in entry:
        return entry["state"]
    sharded = entry.get("sharded")
    return sharded.get("state") if isinstance(sharded, dict) else None


def on_disk(path):
    """What a checkpoint holds of the rerun state: the common entry's state, and the sharded keys."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    common = dist_checkpointing.load_common_state_dict(path).get("rerun_state_machine")
    keys = FileSystemReader(path).read_metadata().state_dict_metadata
    return {
        "common_state": None if common is None or entry_state(common) is None else entry_state(common).name,
        "sharded": sorted(k for k in keys if k.startswith("rerun_state_machine")),
    }


def machine_view(machine):
    out = {f: getattr(machine, f) for f in FIELDS}
    out["state"] = out["state"].name
    out["initial_result"] = None if out["initial_result"] is None else float(out["initial_result"])
    out["failed_validation_call"] = repr(out["failed_validation_call"])
    out["data_iterator_checkpoints"] = repr(machine.data_iterator_checkpoints)
    return out


def error_line(exc):
    """``Type: message``; for torch DCP's CheckpointException (every rank's traceback) its first
    error line, without the rank's shard suffix of the key (the full text stays in raw_error)."""
    text = str(exc)
    for line in text.splitlines():
        if line.startswith("RuntimeError: "):
            return f"{type(exc).__name__}: {line[len('RuntimeError: ') :].split('/shard_')[0]}"
    return f"{type(exc).__name__}: {text}"


def _train_and_save(rt, ckpt_dir, rank):
    """Step 1 and the steady-state save, step 2 (the fault) and its save, with one strategy, as
    save_checkpoint makes them; returns this rank's model shard and the two checkpoints."""
    strategy = cached_save_strategy()
    paths = [os.path.join(ckpt_dir, it) for it in ("iter_1", "iter_2")]
    with fresh_machine() as (machine, data):
        w, model_sd = model_shard(rank, 1)
        assert drive_step(machine, data)[0] is False
        save_with_rerun_state(paths[0], strategy, True, model_sd, machine, data)
        rt["fault_exit"] = list(drive_step(machine, data))
        rt["saved"] = _saved(machine, data)
        save_with_rerun_state(paths[1], strategy, False, model_sd, machine, data)
    rt["on_disk"] = [on_disk(p) for p in paths]
    return w, paths


def _saved(machine, data):
    saved = machine_view(machine)
    saved["data_iterator_checkpoints"] = repr([data.state_dict()])
    return saved


def _resume(path, rank, state_dict=None, model=True):
    """A new machine loads ``path`` and runs the step again: what it restored and what it did."""
    with fresh_machine() as (machine, data):
        model_sd = model_shard(rank, 2)[1] if model else None
        loaded = load_with_rerun_state(path, model_sd, machine, state_dict)
        restored = machine_view(machine)
        restored["resumed_exit"] = list(drive_step(machine, data))
        restored["resumed_state"] = machine.state.name
    return loaded, restored


def parameters_of(model):
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def _through_megatron_training(rt, training, ckpt_dir):
    """The same two saves with save_checkpoint (one checkpointing_context, as the training loop
    keeps it) after a real training step, and load_checkpoint into a new model."""
    from megatron.core import parallel_state as mpu

    from ....testing import gpt_job as job
    from ....testing.job_config import Config

    cfg = Config("dense-dp2", "dense GPT, DP=2", world=2)
    with job.worker(cfg, placement.current()) as cpu_gen:
        args = job.parse_args(cfg, ckpt_dir, 2)
        args.ckpt_assume_constant_structure = True
        mpu.initialize_model_parallel()
        job.seed(args)
        model, optimizer, scheduler = job.build(args, cfg)
        context = {}
        with fresh_machine() as (machine, data):
            job.train_step(model, optimizer, scheduler, args, cpu_gen)
            assert drive_step(machine, data)[0] is False
            training.save_checkpoint(1, [model], optimizer, scheduler, 0, context, train_data_iterator=data)
            rt["fault_exit"] = list(drive_step(machine, data))
            rt["saved"] = _saved(machine, data)
            training.save_checkpoint(2, [model], optimizer, scheduler, 0, context, train_data_iterator=data)
        saved = parameters_of(model)
        dist.barrier()
        paths = [training.get_checkpoint_name(ckpt_dir, it, return_base_dir=True) for it in (1, 2)]
        rt["on_disk"] = [on_disk(p) for p in paths]
        rt.phase("load")
        model, optimizer, scheduler = job.build(args, cfg)
        with fresh_machine() as (machine, data):
            rt["iteration"] = training.load_checkpoint([model], optimizer, scheduler, checkpointing_context={})[0]
            rt["loaded"] = machine_view(machine)
            rt["loaded"]["resumed_exit"] = list(drive_step(machine, data))
            rt["loaded"]["resumed_state"] = machine.state.name
        rt.compare(saved, parameters_of(model), prefix="model/")
    return paths


def _through_dist_checkpointing(rt, ckpt_dir, rank):
    w, paths = _train_and_save(rt, ckpt_dir, rank)
    rt.phase("load")
    loaded, rt["loaded"] = _resume(paths[1], rank)
    rt.compare({"model/w": w}, {"model/w": loaded["model"]["w"]})
    return paths


def cached_reader_missing():
    """None, or why megatron.training cannot load with --ckpt-assume-constant-structure here:
    0.17.0 reads such a load through nvidia-resiliency-ext's cached-metadata reader whatever the
    job's async strategy (its default; 0.17.1 defaults to Megatron-Core's own), and stops with
    ModuleNotFoundError where that package is not installed."""
    import importlib.util
    import inspect

    from megatron.core.dist_checkpointing.strategies import torch as strategies

    from ....engine.patching import original

    # The release's own reader, not the shared-metadata layer in its place.
    reader = original(strategies, "_get_filesystem_reader") if hasattr(strategies, "_get_filesystem_reader") else None
    default = inspect.signature(reader).parameters.get("async_strategy") if reader is not None else None
    if default is None or default.default != "nvrx" or importlib.util.find_spec("nvidia_resiliency_ext"):
        return None
    return "megatron.training's load with --ckpt-assume-constant-structure needs nvidia-resiliency-ext on this release"


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    from megatron.core.rerun_state_machine import RerunStateMachine

    from ....engine.patching import original
    from ....testing._cpu_shims import cuda_to_cpu_mode

    rt = RoundTrip(error_line=error_line)
    training = training_checkpointing()
    rt["through"] = "megatron.training" if training is not None else "dist_checkpointing"
    if training is not None and cached_reader_missing():
        training, rt["through"] = None, f"dist_checkpointing ({cached_reader_missing()})"
    on_cpu = device == "cpu" and not torch.cuda.is_available()
    with placement.on(device), rt.running():
        rt["device"] = str(placement.device())
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt.phase("save")
        if training is not None:
            paths = _through_megatron_training(rt, training, ckpt_dir)
        # The machine all-reduces its requests in tensors made with device="cuda".
        with cuda_to_cpu_mode() if on_cpu else contextlib.nullcontext():
            if training is None:
                paths = _through_dist_checkpointing(rt, ckpt_dir, rank)
            if patched:
                # What the release's own load makes of them (the fix changes no load request).
                rt.phase("load")
                release = original(RerunStateMachine, "state_dict")
                rt["loaded_by_release"] = _resume(paths[1], rank, release, model=False)[1]
                rt["steady_by_release"] = _resume(paths[0], rank, release, model=False)[1]
        rt.phase("rerun-state")
        differ = sorted(k for k in rt["saved"] if rt["saved"][k] != rt["loaded"][k])
        if differ:
            raise AssertionError(f"the rerun state machine after the load differs from the saved one in {differ}")
    return rt.result
