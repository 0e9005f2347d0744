"""rerun-transient-checkpoint's round trip, on 2 gloo ranks.

The real ``RerunStateMachine`` (the process singleton) in ``VALIDATE_RESULTS`` mode with its own
error injector set to a transient error (``error_injection_rate=1``, ``TRANSIENT_ERROR``: the
second step's validated result is rejected, and its rerun in place gives a different one), driven
as ``train_step`` drives it by rerun-state-constant-structure's round trip (its machine, step, save
and load are used here). Step 1 ends normally; at step 2 the machine asks for a checkpoint and exit
with ``EXIT_CODE_FAILED_ON_RESULT_VALIDATION``; the checkpoint is saved; a new machine loads it and
runs the next step, as the job a scheduler resumes from the latest checkpoint does.

Where the release ships ``megatron.training`` (0.17+): the resume check's small GPT after one real
training step, saved with ``megatron.training.checkpointing.save_checkpoint`` (``train_data_iterator``
the machine's iterator) and loaded with ``load_checkpoint`` into a new model. Before 0.17 the calls
``save_checkpoint`` and ``load_checkpoint`` make (rerun-state-constant-structure's ``save_with_rerun_state`` and
``load_with_rerun_state``) with a rank's model shard.

Case ``exit``: the checkpoint this process's machine asks for. With the fix on, also case ``old``:
the machine asks the release's own ``should_checkpoint_and_exit``, so the checkpoint is what an
unfixed release writes, and it is loaded with the fix. Per case: the machine at the save, what is on
disk, the machine after the load (phase ``resume``), the next step's answer and state, the
warnings, and the model, exact.
"""

from __future__ import annotations

import contextlib
import os
import types
import warnings

import torch
import torch.distributed as dist

from ....testing import placement
from ....testing.gpt_job import training_checkpointing
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from ...rerun_state_constant_structure.checks import core as machine_checks
from .. import ID, MODULE

TRANSIENT = "TRANSIENT_ERROR"


def exit_asks_for_checkpoint():
    """None where this release's ``should_checkpoint_and_exit`` asks for a checkpoint at a transient
    fault (what the round trip saves and resumes, fixed or not), else why the scenario does not apply:
    from 0.18.0 that exit writes no checkpoint, and a job resumes from an earlier one."""
    import megatron.core.rerun_state_machine as module

    from ..runtime.core import release_exit_at_transient_fault

    if release_exit_at_transient_fault(module)[0]:
        return None
    return "this release asks for no checkpoint at a transient fault: the job resumes from an earlier one"


def prepare() -> None:
    """In the parent of a forked world: the modules the ranks use."""
    machine_checks.prepare()


def _to_the_fault(out, machine, data, release_exit):
    """Step 1 (not validated: the machine validates from the second step on) and step 2, whose
    result is rejected and whose rerun in place differs. ``release_exit``: the machine asks the
    release's own ``should_checkpoint_and_exit``, as an unfixed release does."""
    if release_exit:
        from megatron.core.rerun_state_machine import RerunStateMachine

        from ....engine.patching import original

        release = original(RerunStateMachine, "should_checkpoint_and_exit")
        machine.should_checkpoint_and_exit = types.MethodType(release, machine)
    assert machine_checks.drive_step(machine, data)[0] is False
    out["fault_exit"] = list(machine_checks.drive_step(machine, data))
    out["saved"] = machine_checks.machine_view(machine)


@contextlib.contextmanager
def _resuming(out, machine, data):
    """The load inside; then the machine as loaded, the next step's answer and state, and the
    warnings the load gave (their text)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    out["warnings"] = [str(w.message) for w in caught if ID in str(w.message)]
    out["loaded"] = machine_checks.machine_view(machine)
    out["resumed_exit"] = list(machine_checks.drive_step(machine, data))
    out["resumed_state"] = machine.state.name


def _through_dist_checkpointing(rt, ckpt_dir, rank, cases):
    with machine_checks.megatron_groups():
        _each_case_through_dist_checkpointing(rt, ckpt_dir, rank, cases)


def _each_case_through_dist_checkpointing(rt, ckpt_dir, rank, cases):
    for case in cases:
        out = rt["cases"][case] = {}
        path = os.path.join(ckpt_dir, case)
        rt.phase("save")
        with machine_checks.fresh_machine(TRANSIENT) as (machine, data):
            w, model_sd = machine_checks.model_shard(rank, 1)
            _to_the_fault(out, machine, data, case == "old")
            machine_checks.save_with_rerun_state(
                path, machine_checks.cached_save_strategy(), True, model_sd, machine, data
            )
        out["on_disk"] = machine_checks.on_disk(path)
        rt.phase("resume")
        with machine_checks.fresh_machine(TRANSIENT) as (machine, data):
            with _resuming(out, machine, data):
                loaded = machine_checks.load_with_rerun_state(path, machine_checks.model_shard(rank, 2)[1], machine)
        rt.compare({"model/w": w}, {"model/w": loaded["model"]["w"]}, prefix=f"{case}/")


def _through_megatron_training(rt, training, ckpt_dir, cases):
    """After one real training step: each case's fault, save_checkpoint at the last completed
    iteration (as the training loop saves at that exit), load_checkpoint into a new model."""
    from megatron.core import parallel_state as mpu

    from ....testing import gpt_job as job
    from ....testing.job_config import Config

    cfg = Config("dense-dp2", "dense GPT, DP=2", world=2)
    with job.worker(cfg, placement.current()) as cpu_gen:
        args = job.parse_args(cfg, ckpt_dir, 2)
        mpu.initialize_model_parallel()
        job.seed(args)
        model, optimizer, scheduler = job.build(args, cfg)
        job.train_step(model, optimizer, scheduler, args, cpu_gen)
        saved = machine_checks.parameters_of(model)
        for case in cases:
            out = rt["cases"][case] = {}
            args.save = args.load = os.path.join(ckpt_dir, case)
            rt.phase("save")
            with machine_checks.fresh_machine(TRANSIENT) as (machine, data):
                _to_the_fault(out, machine, data, case == "old")
                training.save_checkpoint(1, [model], optimizer, scheduler, 0, {}, train_data_iterator=data)
            dist.barrier()
            out["on_disk"] = machine_checks.on_disk(training.get_checkpoint_name(args.save, 1, return_base_dir=True))
            rt.phase("resume")
            new_model, new_optimizer, new_scheduler = job.build(args, cfg)
            with machine_checks.fresh_machine(TRANSIENT) as (machine, data):
                with _resuming(out, machine, data):
                    out["iteration"] = training.load_checkpoint(
                        [new_model], new_optimizer, new_scheduler, checkpointing_context={}
                    )[0]
            rt.compare(saved, machine_checks.parameters_of(new_model), prefix=f"{case}/model/")


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    from ....testing._cpu_shims import cuda_to_cpu_mode

    rt = RoundTrip(error_line=machine_checks.error_line, cases={})
    training = training_checkpointing()
    rt["through"] = "megatron.training" if training is not None else "dist_checkpointing"
    # With the fix on, also what an unfixed release wrote, loaded with the fix.
    cases = ("exit", "old") if patched else ("exit",)
    on_cpu = device == "cpu" and not torch.cuda.is_available()
    with placement.on(device), rt.running():
        rt["device"] = str(placement.device())
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        if training is not None:
            _through_megatron_training(rt, training, ckpt_dir, cases)
        else:
            # The machine all-reduces its requests in tensors made with device="cuda".
            with cuda_to_cpu_mode() if on_cpu else contextlib.nullcontext():
                _through_dist_checkpointing(rt, ckpt_dir, rank, cases)
    return rt.result
