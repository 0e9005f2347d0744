"""rng-under-ep round trips through ms-swift's own checkpoint functions
(``swift.megatron.utils.megatron_lm_utils``: ``initialize_megatron``, ``save_mcore_checkpoint``,
``load_mcore_checkpoint``, and through them ``_get_rng_state`` and ms-swift's RNG restore).

World 2 with EP=2 (TP=PP=1, so DP=2 and the two EP ranks are the two data-parallel ranks), a small
real ``GPTModel`` with two local (non-TE) experts, one per EP rank, gloo on CPU. ms-swift's
``initialize_megatron`` builds the parallel state and seeds (``mcore_bridge.set_random_seed``), then
every rank draws a rank-dependent number of values from every generator and every RNG tracker
stream, as dropout and MoE router noise do, so that every RNG component differs between the ranks.

What is not ms-swift's own here: its arguments are an ``argparse.Namespace`` with the fields these
functions read (``MegatronArguments`` needs a Hugging Face model directory to build), at ms-swift's
defaults (``strict_fsdp_dtensor_load=True`` included); the model is built directly (ms-swift builds
it from a Hugging Face config through mcore-bridge). Whatever reads or writes the RNG state is
ms-swift's code.

CPU stand-ins (these workers only, never by ``import mcore_ckpt_fixes``):

* :class:`.core.CudaRngStandIn` (a CPU generator plays the CUDA generator; ms-swift's
  ``_load_iteration`` all-reduces the iteration in a CUDA tensor, which becomes a CPU tensor), and
  ``cpu_shims`` (``torch.cuda.current_device()`` is the CPU: ``initialize_megatron`` sets the MoE
  aux-loss scale on it). ``mcore_bridge.set_random_seed`` seeds Megatron's RNG tracker only where a
  GPU is seen; here :func:`_seed_and_consume` seeds it as it would (same seed formula).
* :func:`_cuda_tensors_on_cpu`, around the load only: ms-swift always loads through
  ``FullyParallelLoadStrategyWrapper``, whose shard exchange (``dist_checkpointing.exchange_utils``)
  allocates its buffers with ``device="cuda"`` and ``.cuda()``; there they are CPU tensors (gloo
  broadcasts them as well). Where CUDA exists nothing is stood in for.
* Transformer Engine (:func:`import_swift`): ``import swift.megatron.utils.megatron_lm_utils``
  imports ``mcore_bridge``, whose import-time patches run ``import transformer_engine`` without a
  fallback (``mcore_bridge/patcher.py`` ``_patch_transformer_engine``) and set an attribute on
  Megatron-Core's ``TEGroupedLinear``, which is ``None`` without Transformer Engine
  (``_patch_TEGroupedLinear``). Transformer Engine cannot be installed without CUDA. While
  ``mcore_bridge``'s package body runs (only then), an empty ``transformer_engine`` package stands in
  for it (no ``transformer_engine.pytorch``: every Megatron-Core probe of it fails as on any CPU host)
  and ``TEGroupedLinear`` is a placeholder class; both are taken away right after. Megatron-Core
  modules that probe for Transformer Engine are imported before, so none of them sees the stand-in
  (checked: no Megatron-Core module imported meanwhile has ``HAVE_TE`` set).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
import types
import warnings

import torch
import torch.distributed as dist

from ....testing.states import fix_states
from .. import ID as FIX_ID
from .core import (
    EP,
    FRESH_SEED,
    SEED,
    CudaRngStandIn,
    model_tensors,
    compare_exact,
    consume_streams,
    scenario_round_trip,
    scramble_parameters,
    teardown_model_parallel,
    snapshot,
)

MODULE = "swift.megatron.utils.megatron_lm_utils"

# Megatron-Core modules that decide HAVE_TE with a bare ``import transformer_engine``: imported
# before the stand-in exists (those mcore-bridge and ms-swift reach, and then some).
_TE_PROBING_MODULES = (
    "megatron.core.extensions.transformer_engine",
    "megatron.core.fp8_utils",
    "megatron.core.fp4_utils",
    "megatron.core.transformer.mlp",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.ssm.mamba_context_parallel",
    "megatron.core.models.gpt",
)


@contextlib.contextmanager
def _transformer_engine_stand_in():
    """An empty ``transformer_engine`` package and a ``TEGroupedLinear`` placeholder, for the body of
    ``mcore_bridge`` only (see the module docstring). A real Transformer Engine always wins."""
    try:
        real = importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        real = False
    if real:
        yield
        return
    for name in _TE_PROBING_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    te_ext = sys.modules["megatron.core.extensions.transformer_engine"]
    te = types.ModuleType(
        "transformer_engine", "stand-in (mcore_ckpt_fixes ms-swift round trips): no Transformer Engine here"
    )
    te.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None, is_package=True)
    te.__path__ = []  # a package without submodules: `import transformer_engine.pytorch` fails
    placeholder = getattr(te_ext, "TEGroupedLinear", None) is None
    if placeholder:
        te_ext.TEGroupedLinear = type("TEGroupedLinearStandIn", (), {"__doc__": "stand-in: no Transformer Engine"})
    before = set(sys.modules)
    sys.modules["transformer_engine"] = te
    try:
        yield
    finally:
        if sys.modules.get("transformer_engine") is te:
            del sys.modules["transformer_engine"]
        if placeholder:
            te_ext.TEGroupedLinear = None
    fooled = sorted(
        name
        for name in set(sys.modules) - before
        if name.startswith("megatron.") and getattr(sys.modules[name], "HAVE_TE", False) is True
    )
    assert not fooled, f"Megatron-Core modules saw the transformer_engine stand-in: {fooled}"


def import_swift():
    """``swift.megatron.utils.megatron_lm_utils``, imported with the Transformer Engine stand-in
    around ``mcore_bridge``'s import (see the module docstring)."""
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    if "mcore_bridge" not in sys.modules:
        with _transformer_engine_stand_in(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import mcore_bridge  # noqa: F401  (its import-time patches run here)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(MODULE)


@contextlib.contextmanager
def _cuda_tensors_on_cpu():
    """``torch.empty`` / ``torch.empty_like`` with ``device="cuda"`` and ``Tensor.cuda()`` give CPU
    tensors (see the module docstring); nothing changes where CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    empty, empty_like, to_cuda = torch.empty, torch.empty_like, torch.Tensor.cuda

    def cpu(kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return kwargs

    torch.empty = lambda *args, **kwargs: empty(*args, **cpu(kwargs))
    torch.empty_like = lambda *args, **kwargs: empty_like(*args, **cpu(kwargs))
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.cuda = empty, empty_like, to_cuda


# -- setup ------------------------------------------------------------------------------------------


def _args(ckpt_dir, fsdp_dtensor=False, data_parallel_random_init=False, no_load_rng=False):
    """The fields of ms-swift's ``MegatronArguments`` these functions read, at ms-swift's defaults."""
    return argparse.Namespace(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1,
        expert_model_parallel_size=EP,
        expert_tensor_parallel_size=1,
        ddp_backend="gloo",
        ddp_timeout=18000000,
        seed=SEED,
        te_rng_tracker=False,
        data_parallel_random_init=data_parallel_random_init,
        model_info=types.SimpleNamespace(is_moe_model=True),
        output_dir=ckpt_dir,
        mcore_model=ckpt_dir,
        async_save=False,
        use_megatron_fsdp=fsdp_dtensor,
        strict_fsdp_dtensor_load=True,
        num_experts=EP,
        swiglu=False,
        dist_ckpt_save_pre_mcore_014=False,
        dist_ckpt_optim_fully_reshardable=False,
        distrib_optim_fully_reshardable_mem_efficient=False,
        no_save_optim=True,
        no_load_optim=True,
        no_save_rng=False,
        no_load_rng=no_load_rng,
        finetune=False,
        tuner_type="full",
        use_distributed_optimizer=False,
        fp16=False,
        bf16=False,
    )


def _model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=EP,
        moe_router_topk=2,
        expert_model_parallel_size=EP,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    torch.manual_seed(SEED)  # replicated (non-expert) weights equal on every rank, as after a real init
    return GPTModel(
        config, get_gpt_layer_local_spec(num_experts=EP, moe_grouped_gemm=False), vocab_size=32, max_sequence_length=8
    )


def _setup(ckpt_dir, **flags):
    """ms-swift's module, its ``initialize_megatron`` (parallel state, seeds), a model."""
    from megatron.core import parallel_state as mpu

    m = import_swift()
    args = _args(ckpt_dir, **flags)
    m.initialize_megatron(args)
    assert mpu.get_expert_model_parallel_world_size() == EP and mpu.get_data_parallel_world_size() == EP
    return m, args, _model()


def _seed_and_consume(m, args, stand_in, seed):
    """ms-swift's seeding, then rank-dependent draws from every generator and tracker stream."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    m.set_random_seed(seed, args.data_parallel_random_init, args.te_rng_tracker)  # mcore_bridge's
    if not torch.cuda.is_available():  # set_random_seed seeds the tracker only when it sees a GPU
        rank_seed = seed + 1009 * mpu.get_pipeline_model_parallel_rank()
        if args.data_parallel_random_init:
            rank_seed += 11 * mpu.get_data_parallel_rank()
        tensor_parallel.model_parallel_cuda_manual_seed(rank_seed)
    consume_streams(stand_in, seed)


def _saved_layout(m, args):
    """The RNG object ms-swift's ``_get_rng_state`` (with or without the fix) describes."""
    obj = m._get_rng_state(
        fsdp_dtensor=args.use_megatron_fsdp, data_parallel_random_init=args.data_parallel_random_init
    )
    if isinstance(obj, dict):  # fsdp_dtensor: a plain dict, keyed by its layout
        return sorted(obj)
    return list(obj.global_shape), list(obj.global_offset), obj.replica_id


def _save(m, args, model, stand_in, rt, patched):
    _seed_and_consume(m, args, stand_in, SEED)
    rt.phase("precondition")
    rt["fix_state"] = fix_states(FIX_ID, (MODULE,), patched)
    rt["layout"] = _saved_layout(m, args)
    rt.phase("save")
    saved = snapshot()
    m.save_mcore_checkpoint(args, [model], iteration=1, output_dir=args.output_dir)
    dist.barrier()
    return saved


def _load(m, args, model, stand_in, rt):
    rt.phase("perturb")
    _seed_and_consume(m, args, stand_in, FRESH_SEED)  # other states than the saved ones, on every rank
    before = snapshot()
    rt.phase("load")
    with warnings.catch_warnings(record=True) as caught, _cuda_tensors_on_cpu():
        warnings.simplefilter("always")
        iteration = m.load_mcore_checkpoint(args, [model], load_arg="mcore_model")
    # This fix's MegatronPatchWarning, or the plain warning of the source patch.
    rt["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught if "RNG state" in str(w.message)]
    assert iteration == 1, f"load_mcore_checkpoint returned iteration {iteration}, expected 1"
    return before, snapshot()


# -- scenarios --------------------------------------------------------------------------------------


def ep2_round_trip(rank, world_size, ckpt_dir, patched, fsdp_dtensor=False, data_parallel_random_init=False):
    """save_mcore_checkpoint, new RNG states everywhere, load_mcore_checkpoint: every rank's RNG
    states (and its model, experts included) must be what it saved. ``max_delta``: per RNG component."""
    assert world_size == EP, f"rng-under-ep scenarios need world size {EP}, got {world_size}"
    rt = scenario_round_trip("cpu")
    with CudaRngStandIn() as stand_in, rt.running():
        m, args, model = _setup(
            ckpt_dir, fsdp_dtensor=fsdp_dtensor, data_parallel_random_init=data_parallel_random_init
        )
        saved = _save(m, args, model, stand_in, rt, patched)
        saved_model = model_tensors(model)
        scramble_parameters(model)
        _, loaded = _load(m, args, model, stand_in, rt)
        compare_exact(rt, saved, loaded, saved_model, model_tensors(model))
    teardown_model_parallel()
    return rt.result


def load_only(
    rank, world_size, ckpt_dir, patched, fsdp_dtensor=False, data_parallel_random_init=False, no_load_rng=False
):
    """The load half alone, in a fresh world (``before``: the states just before loading,
    ``loaded``: just after; ``warnings``: the warnings about the RNG state raised meanwhile)."""
    assert world_size == EP, f"rng-under-ep scenarios need world size {EP}, got {world_size}"
    rt = scenario_round_trip("cpu")
    with CudaRngStandIn() as stand_in, rt.running():
        m, args, model = _setup(
            ckpt_dir,
            fsdp_dtensor=fsdp_dtensor,
            data_parallel_random_init=data_parallel_random_init,
            no_load_rng=no_load_rng,
        )
        rt.phase("precondition")
        rt["fix_state"] = fix_states(FIX_ID, (MODULE,), patched)
        rt["before"], rt["loaded"] = _load(m, args, model, stand_in, rt)
        rt["n_tensors"] = len(rt["loaded"])
    teardown_model_parallel()
    return rt.result
