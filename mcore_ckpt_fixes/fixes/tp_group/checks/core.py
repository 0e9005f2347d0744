"""tp-group round trips: models built from an explicit ``ProcessGroupCollection``, no ``parallel_state``.

Each scenario runs on a world of 2 ranks with TP=2 (``parallel_state`` stays uninitialised:
that is the point), builds a model with rank-dependent deterministic values, saves it with
``dist_checkpointing.save``, loads it into a fresh model with other values and requires every
tensor to come back bit-exact on every rank. They are registered, with the error each one shows
without the fix, in :mod:`.scenarios`.

``device="cpu"`` (the tests, ``selftest``): a gloo world, the worker's CPU shims, parameters
initialised on the CPU. ``device="cuda"`` (``selftest --device cuda``): an NCCL world of spawned
workers, each on its own GPU; the model is initialised on that GPU as Megatron's training loop
does (``use_cpu_initialization=False``) and moved there whole afterwards (RADIO's class token and
position embedding are plain CPU tensors at construction). The CUDA path has not been run on a
GPU by this project's CI: nothing in it is exercised on the CPU hosts the tests run on.

``mamba_ssm`` is stood in for (:mod:`mcore_ckpt_fixes.testing._standins` says exactly what and
why); everything else (MambaStack, MambaLayer, MambaMixer, ExtendedRMSNorm's ``sharded_state_dict``,
the parallel linears, RADIOViTModel, dist_checkpointing) is the real code.
"""

from __future__ import annotations

import inspect
import os
import zlib

import torch
import torch.distributed as dist

from ....testing.result import RoundTrip
from ....testing._standins import install_mamba_ssm_stand_in
from ....testing.states import fix_states

TP = 2
HIDDEN = 64
SAVE_SEED, FRESH_SEED = 1234, 98765
_LAYER, _MIXER = "megatron.core.ssm.mamba_layer", "megatron.core.ssm.mamba_mixer"
_RADIO = "megatron.core.models.vision.radio"

# -- groups, config ------------------------------------------------------------------------------


def _process_groups():
    """A ProcessGroupCollection for TP=2 over the whole world; every rank creates every group."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == TP, f"tp_group scenarios need world size {TP}, got {world}"
    everyone = dist.new_group(list(range(world)))
    # new_group is collective over the default group: all ranks build each singleton in order.
    alone = [dist.new_group([r]) for r in range(world)][rank]
    return ProcessGroupCollection(
        tp=everyone, tp_cp=everyone, mp=everyone, tp_dp_cp=everyone, cp=alone, pp=alone, dp=alone, dp_cp=alone
    )


def _config(device="cpu", **extra):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        tensor_model_parallel_size=TP,
        use_cpu_initialization=_device(device).type == "cpu",
        params_dtype=torch.float32,
        **extra,
    )


def _device(device):
    """``"cpu"`` or ``"cuda"`` -> the torch device this rank works on (the worker set the GPU)."""
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


def _place(model, device):
    """Move the whole model to ``device`` (a no-op on CPU): parameters keep their identity and
    Megatron's attributes (``tensor_model_parallel`` ...), as with ``model.cuda()`` in training."""
    dev = _device(device)
    return model if dev.type == "cpu" else model.to(dev)


def seed_rng(seed, tp_rank):
    """Seed CPU and Megatron's (CUDA-named) tracker RNGs, as a training script would."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)


# -- the round trip ------------------------------------------------------------------------------


def fill_deterministic(model, seed, tp_rank):
    """Give every tensor deterministic values: TP-sharded ones differ per TP rank, replicated ones
    are equal on all TP ranks (as after a real init), and a different seed gives other values
    everywhere, so the comparison after load cannot pass by accident (e.g. ``D`` starts as ones)."""
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                continue
            sharded = getattr(t, "tensor_model_parallel", False)
            # crc32, not hash(): str hashes are salted per process, and ranks must agree.
            key = f"{seed}/{tp_rank if sharded else -1}/{name}"
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype))


def _tensors(model):
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _fix_states(patched, modules):
    """The tp-group fix's state for the modules the model uses; asserts it matches ``patched`` so a
    misconfigured world cannot pass as "fixed" (0.19 round trips exactly with or without it)."""
    return fix_states("tp-group", modules, patched)


def _round_trip(build, ckpt_dir, pgs, patched, modules, device="cpu"):
    """build(seed) -> model: saved, loaded into a fresh model with other values, compared."""
    from megatron.core import dist_checkpointing

    tp_rank = pgs.tp.rank()
    rt = RoundTrip(device=str(_device(device)))
    metadata = {"dp_cp_group": pgs.dp_cp}
    with rt.running():  # ranks fail alike here, before any collective: no hang
        rt.phase("build")
        saved = _place(build(SAVE_SEED), device)
        fill_deterministic(saved, SAVE_SEED, tp_rank)
        _check_device(saved, device)
        rt.phase("precondition")  # after build: the fix's targets are probed when first imported
        rt["fix_state"] = _fix_states(patched, modules)
        rt.phase("sharded_state_dict")
        sd = saved.sharded_state_dict(prefix="", metadata=metadata)
        rt.phase("save")
        dist_checkpointing.save(sd, ckpt_dir)
        dist.barrier()
        rt.phase("build_fresh")
        fresh = _place(build(FRESH_SEED), device)
        fill_deterministic(fresh, FRESH_SEED, tp_rank)
        before, after = _tensors(saved), _tensors(fresh)
        assert before.keys() == after.keys(), f"state_dict keys differ: {sorted(before.keys() ^ after.keys())}"
        same = [k for k, t in before.items() if t.is_floating_point() and t.numel() and torch.equal(t, after[k])]
        assert not same, f"fresh model already equals the saved one on {same}: the check would be vacuous"
        rt.phase("load")
        loaded = dist_checkpointing.load(fresh.sharded_state_dict(prefix="", metadata=metadata), ckpt_dir)
        fresh.load_state_dict(loaded)
        bad = rt.compare(before, _tensors(fresh))
        assert not bad, f"tensors differ after load: {bad}"
    return rt.result


def _check_device(model, device):
    """Every tensor of the model is on the rank's device: a CUDA run must not quietly test CPU tensors."""
    want = _device(device)
    elsewhere = sorted(k for k, t in _tensors(model).items() if t.device.type != want.type)
    assert not elsewhere, f"tensors not on {want}: {elsewhere}"


# -- scenarios -----------------------------------------------------------------------------------


def prepare() -> None:
    """Run in the parent before any world starts (``selftest``, the tests' warm parent): the
    ``mamba_ssm`` stand-in must be in place before ``mamba_mixer`` is imported, and importing
    Megatron here once lets every forked world start warm."""
    install_mamba_ssm_stand_in()
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.vision.radio  # noqa: F401
    import megatron.core.ssm.mamba_block  # noqa: F401
    import megatron.core.ssm.mamba_mixer  # noqa: F401


def mamba_stack(rank: int, world_size: int, ckpt_dir: str, patched: bool, device: str = "cpu") -> dict:
    """A real two-layer MambaStack ("MM") with the local (non-TE) layer spec."""
    install_mamba_ssm_stand_in()
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    pgs = _process_groups()
    config = _config(device, mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2)
    layer_spec = ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=WrappedTorchNorm,
            mixer=ModuleSpec(
                module=MambaMixer,
                submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
            ),
            mamba_bda=get_bias_dropout_add,
        ),
    )
    params = inspect.signature(MambaStack.__init__).parameters
    # 0.16 allocates layers from a pattern; 0.17+ takes the allocated list.
    if "hybrid_override_pattern" in params:
        layers = {"hybrid_override_pattern": "MM"}
    else:
        layers = {"layer_type_list": ["M", "M"]}

    def build(seed):
        seed_rng(seed, pgs.tp.rank())
        # post_layer_norm=False: the stack's final norm is hard-wired to TENorm (TransformerEngine).
        submodules = MambaStackSubmodules(mamba_layer=layer_spec)
        return MambaStack(config, submodules, post_layer_norm=False, pg_collection=pgs, **layers)

    return _round_trip(build, ckpt_dir, pgs, patched, (_LAYER, _MIXER), device)


def mixer_factory(pgs, device: str = "cpu"):
    """() -> a real MambaMixer with its gated RMSNorm (ExtendedRMSNorm), built from ``pgs``."""
    install_mamba_ssm_stand_in()
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    config = _config(device, mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2)
    sub = MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)
    return lambda: MambaMixer(config, sub, d_model=HIDDEN, rmsnorm=True, pg_collection=pgs)


def radio_factory(pgs, device: str = "cpu"):
    """() -> a small RADIOViTModel with the local ViT layer spec; ``pgs=None`` is the classic call
    (groups from parallel_state)."""
    from megatron.core.models.vision.radio import RADIOViTModel

    try:
        from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec as local_spec
    except ImportError:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec as local_spec

    config = _config(device)
    return lambda: RADIOViTModel(
        config,
        local_spec(),
        class_token_len=2,
        patch_dim=4,
        img_h=16,
        img_w=16,
        max_img_h=16,
        max_img_w=16,
        pg_collection=pgs,
    )


def _seeded(make, pgs):
    def build(seed):
        seed_rng(seed, pgs.tp.rank())
        return make()

    return build


def mamba_mixer(rank: int, world_size: int, ckpt_dir: str, patched: bool, device: str = "cpu") -> dict:
    """A lone real MambaMixer with its gated RMSNorm (ExtendedRMSNorm)."""
    pgs = _process_groups()
    build = _seeded(mixer_factory(pgs, device), pgs)
    return _round_trip(build, ckpt_dir, pgs, patched, (_MIXER,), device)


def radio_vit(rank: int, world_size: int, ckpt_dir: str, patched: bool, device: str = "cpu") -> dict:
    """A small RADIOViTModel with the local ViT layer spec."""
    pgs = _process_groups()
    build = _seeded(radio_factory(pgs, device), pgs)
    return _round_trip(build, ckpt_dir, pgs, patched, (_RADIO,), device)


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """Several scenarios in one world (``names``, default all three; each in a folder of its own
    and with its own process groups): ``{name: result}``."""
    scenarios = {"mamba_stack": mamba_stack, "mamba_mixer": mamba_mixer, "radio_vit": radio_vit}
    out = {}
    for name, run in scenarios.items():
        if name in (names or scenarios):
            path = os.path.join(ckpt_dir, name)
            os.makedirs(path, exist_ok=True)  # every rank, before its save: no rank waits on another's
            out[name] = run(rank, world_size, path, patched, device)
    return out


def explicit_group_checkpointing():
    """None where Megatron's checkpoint helpers take process groups (0.16+), else why the scenarios
    cannot run: up to 0.15 ``make_sharded_tensors_for_checkpoint`` reads parallel_state only, so a
    model built from explicit process groups cannot be checkpointed at all (another gap than the
    one tp-group closes, which is a missing ``tp_group`` on 0.16-0.18)."""
    from megatron.core.transformer import utils

    if "dp_cp_group" in utils.make_sharded_tensors_for_checkpoint.__code__.co_varnames:
        return None
    return (
        "make_sharded_tensors_for_checkpoint takes no process groups in this release: models built from "
        "explicit process groups cannot be checkpointed here at all (tp-group fixes 0.16-0.18)"
    )
