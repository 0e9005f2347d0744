"""rng-under-ep round trips through Megatron's own ``save_checkpoint`` / ``load_checkpoint``.

World 2 with EP=2 (TP=PP=1, so DP=2 and the two EP ranks are the two data-parallel ranks; the save
and load halves also run in a world of 4, DP=4 with two expert-data-parallel ranks per EP rank), a
small real ``GPTModel`` with two local (non-TE) experts, one per EP rank, ``--ckpt-format
torch_dist`` and Megatron's default checkpoint options (fully parallel save and load included).

Why the whole of ``megatron.training.checkpointing``: the bug sits between ``get_rng_state`` (how the
state is described), ``generate_state_dict`` / ``dist_checkpointing`` (who writes it, who reads
it) and the RNG restore at the end of ``load_checkpoint`` (what each rank sets); only the two
public entry points exercise all of them as a training run does. Megatron's arguments come from its
own ``parse_args`` / ``validate_args`` and ``set_global_variables`` (no tokenizer), so every
checkpoint option has the value a user gets by default.

RNG state per rank, as a run has it after some steps: Megatron's seeding (``_set_random_seed``:
Python, NumPy and torch from ``seed + 100 * pp_rank``; ``model_parallel_cuda_manual_seed``: the
tracker's data-parallel, model-parallel and expert-parallel streams, the last one per EP rank),
then each rank draws a rank-dependent number of values from every generator and every tracker
stream, as dropout and the MoE router noise do. So every component differs between the ranks and
a rank that restores another rank's state is visible in each of them.

CPU stand-in (test and selftest workers only, never by ``import mcore_ckpt_fixes``): without a GPU
torch has no CUDA generator, ``torch.cuda.manual_seed`` / ``set_rng_state`` are queued until CUDA
initialises (never), and Megatron's RNG tracker would hold the same state under every name. On a
host without CUDA, :class:`CudaRngStandIn` lets one CPU ``torch.Generator`` play this process's CUDA
default generator for ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` and for
Megatron's ``_set_cuda_rng_state`` (its lazy call runs at once, on that generator), and
``torch.tensor(..., device="cuda")`` (``read_metadata`` all-reduces the iteration in one) makes a CPU
tensor. Everything else (the tracker, seeding, ``get_rng_state``, save, load, restore) is the real
code. With ``device="cuda"`` nothing is stood in for: the real CUDA generator is used (run on an
H100, ranks sharing the GPU over gloo: docs/validation.md, GPU runs).
"""

from __future__ import annotations

import contextlib
import io
import random
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist

from ....testing.compare import max_abs_delta, worst
from ....testing.result import RoundTrip
from ....testing._rng_standin import CudaRngStandIn  # noqa: F401  (the round trips and frameworks' checks use it)
from ....testing.states import fix_states
from .. import ID as FIX_ID
from .. import MODULE

EP = 2
SEED, FRESH_SEED = 1234, 4321


# -- CUDA RNG stand-in (CPU workers only) -----------------------------------------------------------


def prepare() -> None:
    """Run in the parent before any world starts: import what the ranks use, once."""
    import megatron.core.models.gpt  # noqa: F401
    import megatron.training.arguments  # noqa: F401
    import megatron.training.checkpointing  # noqa: F401
    import megatron.training.global_vars  # noqa: F401


def _argv(ckpt_dir, data_parallel_random_init=False, no_load_rng=False):
    argv = [
        "mcore-ckpt-fixes-rng-under-ep",
        "--num-layers",
        "1",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "8",
        "--max-position-embeddings",
        "8",
        # One micro-batch per data-parallel rank (every rank is one).
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        str(dist.get_world_size()),
        "--num-experts",
        str(EP),
        "--expert-model-parallel-size",
        str(EP),
        "--use-cpu-initialization",
        "--ckpt-format",
        "torch_dist",
        "--transformer-impl",
        "local",
        "--no-persist-layer-norm",
        "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion",
        "--no-rope-fusion",
        "--save",
        ckpt_dir,
        "--load",
        ckpt_dir,
        "--save-interval",
        "1",
        "--no-save-optim",
        "--no-load-optim",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "32",
        "--lr",
        "0.1",
        "--train-iters",
        "1",
        "--seed",
        str(SEED),
    ]
    if data_parallel_random_init:
        argv.append("--data-parallel-random-init")
    if no_load_rng:
        argv.append("--no-load-rng")
    return argv


def _setup(ckpt_dir, device, ckpt_format="torch_dist", **flags):
    """Megatron's args (parsed and validated as for a training run), parallel state, a model."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import arguments, global_vars

    saved_argv, sys.argv = sys.argv, _argv(ckpt_dir, **flags)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
            args = arguments.parse_args()
            arguments.validate_args(args, {})
            global_vars.set_global_variables(args, build_tokenizer=False)
        # Megatron-LM main saves the tokenizer's files beside a torch_dist checkpoint by default;
        # this round trip builds no tokenizer (its model takes token ids only).
        if getattr(args, "save_tokenizer_assets", False):
            args.save_tokenizer_assets = False
        if ckpt_format != "torch_dist":
            # fsdp_dtensor: validate_args insists on --use-megatron-fsdp, whose CUDA buffers a CPU
            # host cannot build; the RNG entry does not depend on the model wrapper, so the plain
            # model goes through save_checkpoint's and load_checkpoint's fsdp_dtensor branches.
            args.ckpt_format = ckpt_format
            # load_checkpoint tells fsdp_dtensor from torch_dcp by this flag.
            args.use_megatron_fsdp = ckpt_format == "fsdp_dtensor"
    finally:
        sys.argv = saved_argv
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=EP
    )
    assert mpu.get_expert_model_parallel_world_size() == EP
    assert mpu.get_data_parallel_world_size() == dist.get_world_size()
    config = arguments.core_transformer_config_from_args(args)
    # Replicated (non-expert) weights must be equal on every rank, as after a real init: the same
    # CPU seed everywhere (forked ranks share it anyway; spawned ones may not).
    torch.manual_seed(SEED)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(num_experts=EP, moe_grouped_gemm=False),
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
    )
    if device == "cuda":
        model = model.cuda()
    return args, model


def _seed_and_consume(args, stand_in, seed):
    """Megatron's seeding, then rank-dependent draws from every generator and tracker stream."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.training.initialize import _set_random_seed

    _set_random_seed(seed, args.data_parallel_random_init)
    if not torch.cuda.is_available():  # _set_random_seed seeds the tracker only when it sees a GPU
        rank_seed = seed + 100 * mpu.get_pipeline_model_parallel_rank()
        if args.data_parallel_random_init:
            rank_seed += 10 * mpu.get_data_parallel_rank()
        tensor_parallel.model_parallel_cuda_manual_seed(rank_seed)
    consume_streams(stand_in, seed)


def consume_streams(stand_in, seed):
    """Rank-dependent draws from every generator (Python, NumPy, torch CPU, the CUDA stand-in) and
    every tracker stream, so that no two ranks hold the same RNG state when they save."""
    from megatron.core import tensor_parallel

    draws = 1 + dist.get_rank() + (seed % 7)
    for _ in range(draws):
        random.random()
        np.random.rand()
        torch.rand(1)
        stand_in.draw(1)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    for name in sorted(tracker.get_states()):
        with tracker.fork(name):
            for _ in range(draws):  # separate draws: a CUDA (Philox) state moves per call, not per value
                stand_in.draw(1)


def _state_tensor(state):
    return state.get_state() if isinstance(state, torch.Generator) else state


def snapshot():
    """Every RNG state Megatron checkpoints, as this rank has it now (copies)."""
    from megatron.core import tensor_parallel

    states = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state().clone(),
        "cuda": torch.cuda.get_rng_state().clone(),
    }
    for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        states[f"tracker:{name}"] = _state_tensor(state).clone()
    return states


def _flat(value):
    """(numbers, marks): an RNG state as float64 numbers (exact: every entry is a 32-bit word, a
    position, a flag or a float), and what is not a number. Python ``random``'s cached Gaussian is
    ``None`` when there is none: a mark, never NaN, so that a state holding one and a state holding
    none compare different."""
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64).numpy().ravel(), ()
    if isinstance(value, tuple) and value and value[0] == "MT19937":  # NumPy
        keys, pos, has_gauss, cached = value[1], value[2], value[3], value[4]
        return np.concatenate([np.asarray(keys, dtype=np.float64), [pos, has_gauss, cached]]), ()
    version, internal, gauss = value  # Python's random
    numbers = [version, *internal] + ([] if gauss is None else [gauss])
    return np.array(numbers, dtype=np.float64), (gauss is None,)


def delta(a, b) -> float:
    """Largest absolute difference between two RNG states (0.0: identical; inf: incomparable, e.g.
    one holds a cached Gaussian and the other none)."""
    (fa, ma), (fb, mb) = _flat(a), _flat(b)
    if ma != mb or fa.shape != fb.shape:
        return float("inf")
    if np.array_equal(fa, fb):
        return 0.0
    return float(np.max(np.abs(fa - fb)))


def state_digest(state) -> str:
    """A fingerprint of an RNG state (equal states, equal digests): see testing.compare.digest."""
    import hashlib

    numbers, marks = _flat(state)
    return hashlib.sha256(repr(marks).encode() + numbers.tobytes()).hexdigest()[:16]


def deltas(saved, loaded) -> dict:
    keys = sorted(set(saved) | set(loaded))
    return {k: delta(saved[k], loaded[k]) if k in saved and k in loaded else float("inf") for k in keys}


def same_states(a, b, components) -> bool:
    """Every RNG component of ``a`` is exactly that of ``b`` (and both name exactly ``components``)."""
    assert set(a) == set(b) == set(components), (sorted(a), sorted(b))
    return all(delta(a[k], b[k]) == 0.0 for k in sorted(components))


def assert_ranks_differ(saved, components) -> None:
    """Every pair of ranks saved different states in every component, so that restoring another
    rank's state is visible everywhere (else a test could not fail)."""
    for i in range(len(saved)):
        for j in range(i + 1, len(saved)):
            for k in sorted(components):
                assert delta(saved[i][k], saved[j][k]) != 0.0, (
                    f"ranks {i} and {j} saved the same {k}: the check would be vacuous"
                )


def _fix_state(patched):
    return fix_states(FIX_ID, (MODULE,), patched)


def _saved_layout(args):
    """Shape of the torch_dist RNG object this release (with or without the fix) writes."""
    from megatron.core import parallel_state as mpu
    from megatron.training import checkpointing

    obj = checkpointing.get_rng_state(
        args.ckpt_format, mpu.get_tensor_model_parallel_group(), mpu.get_pipeline_model_parallel_group()
    )
    if isinstance(obj, dict):  # fsdp_dtensor: a plain dict, keyed by its layout
        return sorted(obj)
    return list(obj.global_shape), list(obj.global_offset), obj.replica_id


def model_tensors(model):
    return {k: v.detach().clone().cpu() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def scramble_parameters(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def scenario_round_trip(device):
    """This rank's :class:`RoundTrip` with the fields every rng-under-ep scenario reports.

    Its error policy covers ``SystemExit`` too: load_checkpoint exits on an unreadable RNG state."""
    rt = RoundTrip(
        device="cpu" if device == "cpu" else f"cuda:{torch.cuda.current_device()}",
        saved=None,
        loaded=None,
        warnings=[],
        layout=None,
    )
    rt.phase("setup")
    return rt


def _save(args, model, stand_in, rt, patched):
    from megatron.training.checkpointing import save_checkpoint

    _seed_and_consume(args, stand_in, SEED)
    rt.phase("precondition")
    rt["fix_state"] = _fix_state(patched)
    rt["layout"] = _saved_layout(args)
    rt.phase("save")
    saved = snapshot()
    save_checkpoint(1, [model], None, None, 0)
    dist.barrier()
    return saved


def _load(args, model, stand_in, rt):
    from megatron.training.checkpointing import load_checkpoint

    rt.phase("perturb")
    _seed_and_consume(args, stand_in, FRESH_SEED)  # other states than the saved ones, on every rank
    before = snapshot()
    rt.phase("load")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        iteration, _ = load_checkpoint([model], None, None)
    # This fix's MegatronPatchWarning, or the plain warning of the source patch (patches/rng-under-ep).
    rt["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught if "RNG state" in str(w.message)]
    assert iteration == 1, f"load_checkpoint returned iteration {iteration}, expected 1"
    return before, snapshot()


def teardown_model_parallel():
    from megatron.core import parallel_state as mpu

    with contextlib.suppress(Exception):
        mpu.destroy_model_parallel()


# -- scenarios --------------------------------------------------------------------------------------


def ep2_round_trip(
    rank, world_size, ckpt_dir, patched, device="cpu", data_parallel_random_init=False, ckpt_format="torch_dist"
):
    """save_checkpoint, new RNG states everywhere, load_checkpoint: every rank's RNG states (and its
    model, experts included) must be what it saved. ``max_delta``: per RNG component."""
    assert world_size == EP, f"rng-under-ep scenarios need world size {EP}, got {world_size}"
    rt = scenario_round_trip(device)
    with CudaRngStandIn() as stand_in, rt.running():
        args, model = _setup(ckpt_dir, device, ckpt_format, data_parallel_random_init=data_parallel_random_init)
        saved = _save(args, model, stand_in, rt, patched)
        saved_model = model_tensors(model)
        scramble_parameters(model)
        _, loaded = _load(args, model, stand_in, rt)
        compare_exact(rt, saved, loaded, saved_model, model_tensors(model))
    teardown_model_parallel()
    return rt.result


def compare_exact(rt, saved, loaded, saved_model, after_model):
    """Record and assert: every RNG component and every model tensor back exactly as saved."""
    rt.phase("compare")
    rt["model_max_delta"] = worst(max_abs_delta(saved_model[k], after_model[k]) for k in saved_model)
    rt["saved"], rt["loaded"] = saved, loaded
    rt["n_tensors"] = len(saved)
    # RNG states are not all tensors (Python's and NumPy's are tuples): compared with delta().
    rt["max_delta"] = deltas(saved, loaded)
    # Whose state each component is: the world's judgement (Bug.wrong_values) compares them across ranks.
    rt["digests"] = {k: ([state_digest(saved[k])], [state_digest(loaded[k])]) for k in saved if k in loaded}
    bad = {k: d for k, d in rt["max_delta"].items() if d != 0.0}
    assert not bad, f"RNG states differ after load: {sorted(bad)}"
    assert rt["model_max_delta"] == 0.0, f"model differs after load: {rt['model_max_delta']}"


def ep2_fsdp_dtensor(rank, world_size, ckpt_dir, patched, device="cpu"):
    """The same round trip in the ``fsdp_dtensor`` format (Megatron-FSDP users' format)."""
    return ep2_round_trip(rank, world_size, ckpt_dir, patched, device, ckpt_format="fsdp_dtensor")


def save_only(
    rank, world_size, ckpt_dir, patched, device="cpu", data_parallel_random_init=False, ckpt_format="torch_dist"
):
    """The save half alone (``saved``: this rank's RNG states as they went into the checkpoint)."""
    assert world_size in (EP, 2 * EP), f"rng-under-ep save/load need world size {EP} or {2 * EP}, got {world_size}"
    rt = scenario_round_trip(device)
    with CudaRngStandIn() as stand_in, rt.running():
        args, model = _setup(ckpt_dir, device, ckpt_format, data_parallel_random_init=data_parallel_random_init)
        rt["saved"] = _save(args, model, stand_in, rt, patched)
        rt["n_tensors"] = len(rt["saved"])
    teardown_model_parallel()
    return rt.result


def load_only(
    rank,
    world_size,
    ckpt_dir,
    patched,
    device="cpu",
    no_load_rng=False,
    data_parallel_random_init=False,
    ckpt_format="torch_dist",
):
    """The load half alone, in a fresh world (``before``: the states just before loading,
    ``loaded``: just after; ``warnings``: the warnings about the RNG state load_checkpoint raised)."""
    assert world_size in (EP, 2 * EP), f"rng-under-ep save/load need world size {EP} or {2 * EP}, got {world_size}"
    rt = scenario_round_trip(device)
    with CudaRngStandIn() as stand_in, rt.running():
        args, model = _setup(
            ckpt_dir, device, ckpt_format, no_load_rng=no_load_rng, data_parallel_random_init=data_parallel_random_init
        )
        rt.phase("precondition")
        rt["fix_state"] = _fix_state(patched)
        rt["before"], rt["loaded"] = _load(args, model, stand_in, rt)
        rt["n_tensors"] = len(rt["loaded"])
    teardown_model_parallel()
    return rt.result
