"""chained-optim-main-params-split's round trips: a bf16 MoE GPT (local layers, every layer MoE),
Megatron's DDP and ``get_megatron_optimizer``'s ``ChainedOptimizer`` of two distributed optimizers
(dense and expert parameters), on 2 gloo ranks.

A source model of the same layout in fp32 (values bf16 cannot hold) writes its weights as
Megatron-LM's legacy ``torch`` checkpoint holds them (``{"model": ...}``, or ``{"model0": ...,
"model1": ...}`` with several chunks; ``torch.save`` per rank). The bf16 target loads the model from
it (``load_state_dict``, the bf16 rounding) and then, as ``load_checkpoint`` does with
``--no-load-optim --load-main-params-from-ckpt``, ``optimizer.reload_model_params(state_dict=...)``.
Checked on every rank: each sub-optimizer's fp32 main-parameter shard equals the checkpoint's fp32
values (``max_delta``; phase ``main_params``, one ``AssertionError`` line otherwise, naming the
optimizers whose main parameters hold the bf16 rounding instead).

* ``one_chunk``: EP=2 (DP=2 for the dense optimizer, expert DP=1), one model chunk;
* ``two_chunks``: PP=2 with two virtual stages (two chunks per rank, one layer each), EP=1.

No optimizer state is loaded (``--no-load-optim``): the round trip from the checkpoint's fp32
weights to the optimizer's main parameters is the whole promise here, so it is the check.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ....testing.dist_optimizer import device as world_device
from ....testing.dist_optimizer import world
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE

SOURCE_SEED, TARGET_SEED = 1234, 98765
NUM_EXPERTS = 2
KINDS = ("dense", "expert")  # get_megatron_optimizer's order of the sub-optimizers
BF16_ROUNDED = "hold the bf16 model parameters, not the checkpoint's fp32 values"


@dataclass(frozen=True)
class Case:
    ep: int = 1
    pp: int = 1
    chunks: int = 1  # model chunks per rank (virtual pipeline stages)
    num_experts: int = NUM_EXPERTS
    layer_spec: object = None  # num_experts -> the layer's ModuleSpec; None: the local spec's


def local_moe_spec(num_experts):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)


CASES = {"one_chunk": Case(ep=2), "two_chunks": Case(ep=2, pp=2, chunks=2)}


def prepare() -> None:
    """Run in the parent before any world starts (every forked world starts warm)."""
    import megatron.core.optimizer  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: F401


def _values(seed, name, shape):
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32)


def _parallel(case: Case, device="cpu"):
    return world(
        device,
        pipeline_model_parallel_size=case.pp,
        virtual_pipeline_model_parallel_size=case.chunks if case.chunks > 1 else None,
        expert_model_parallel_size=case.ep,
    )


def _chunks(case: Case, seed, bf16):
    """This rank's GPT chunks (one layer each, MoE), parameters drawn from ``seed`` by name."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=case.pp * case.chunks,
        hidden_size=16,
        num_attention_heads=2,
        use_cpu_initialization=True,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_model_parallel_size=case.pp,
        virtual_pipeline_model_parallel_size=case.chunks if case.chunks > 1 else None,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        num_moe_experts=case.num_experts,
        expert_model_parallel_size=case.ep,
        moe_token_dispatcher_type="allgather",
        add_bias_linear=False,  # 0.14 builds no MoE layer with biases
    )
    spec = (case.layer_spec or local_moe_spec)(case.num_experts)
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    out = []
    for vp in range(case.chunks):
        extra = {"vp_stage": vp} if case.chunks > 1 else {}
        gpt = GPTModel(
            config,
            spec,
            vocab_size=32,
            max_sequence_length=8,
            pre_process=pp_rank == 0 and vp == 0,
            post_process=pp_rank == case.pp - 1 and vp == case.chunks - 1,
            share_embeddings_and_output_weights=False,
            **extra,
        )
        with torch.no_grad():
            for name, p in gpt.named_parameters():
                p.copy_(_values(seed, f"{dist.get_rank()}/{vp}/{name}", p.shape))
        out.append((config, gpt.to(world_device())))
    return out


def _target(case: Case):
    """The bf16 chunks in Float16Module and DDP, and get_megatron_optimizer's ChainedOptimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    model = [
        DistributedDataParallel(config, ddp_config, Float16Module(config, gpt), disable_bucketing=i > 0)
        for i, (config, gpt) in enumerate(_chunks(case, TARGET_SEED, bf16=True))
    ]
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-2, use_distributed_optimizer=True, bf16=True, params_dtype=torch.bfloat16
    )
    return model, get_megatron_optimizer(opt_config, model)


def _checkpoint(case: Case, ckpt_dir, name):
    """Write the fp32 source's weights as a legacy per-rank checkpoint; return what it holds (read back)."""
    sds = [gpt.state_dict() for _, gpt in _chunks(case, SOURCE_SEED, bf16=False)]
    for sd in sds:
        for k, v in sd.items():
            if torch.is_tensor(v) and v.is_floating_point() and v.numel():
                assert v.dtype == torch.float32 and not torch.equal(v, v.bfloat16().float()), k
    state = {"model": sds[0]} if len(sds) == 1 else {f"model{i}": sd for i, sd in enumerate(sds)}
    path = os.path.join(ckpt_dir, name, f"mp_rank_{dist.get_rank():02d}.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(state, path)
    return torch.load(path, weights_only=True)


def _main_params(model, opt, state):
    """(checkpoint's fp32 values, main parameters) per sub-optimizer and parameter: this rank's shards."""
    expected, got = {}, {}
    subs = getattr(opt, "chained_optimizers", None) or [opt]
    sds = [state["model"]] if "model" in state else [state[f"model{i}"] for i in range(len(model))]
    for chunk, (ddp, sd) in enumerate(zip(model, sds)):
        for name, p in ddp.module.module.named_parameters():
            for kind, d in zip(KINDS, subs):
                if p not in d.model_param_group_index_map:
                    continue
                gi, go = d.model_param_group_index_map[p]
                span = d._get_model_param_range_map(p)["param"]
                key = f"{kind}/{chunk}/{name}"
                expected[key] = sd[name].view(-1)[span.start : span.end]
                got[key] = d.optimizer.param_groups[gi]["params"][go].detach().clone()
    return expected, got


def run_case(name, ckpt_dir, patched, cache=None, case=None, fix=(ID, MODULE), device="cpu"):
    """One case (``CASES[name]``, or ``case``), under ``fix`` = (fix id, its target module) on or
    off, the models on ``device``."""
    case = case or CASES[name]
    rt = RoundTrip(case=name, sub_optimizers=None, bf16_rounded=[])
    with rt.running(), _parallel(case, device):
        rt["device"] = str(world_device())
        rt.phase("precondition")
        rt["fix_state"] = fix_states(fix[0], (fix[1],), patched)
        rt.phase("save")
        state = _checkpoint(case, ckpt_dir, name)
        model, opt = _target(case)
        rt["sub_optimizers"] = [type(d).__name__ for d in opt.chained_optimizers]
        rt.phase("load")
        for ddp, key in zip(model, ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]):
            ddp.load_state_dict(state[key])
        rt.phase("reload")
        opt.reload_model_params(state_dict=state)
        expected, got = _main_params(model, opt, state)
        wrong = rt.compare(expected, got)
        rt["bf16_rounded"] = sorted(k for k in wrong if torch.equal(got[k], expected[k].bfloat16().float()))
        if wrong:
            rt.phase("main_params")
            kinds = sorted({k.split("/")[0] for k in wrong})
            what = BF16_ROUNDED if set(wrong) == set(rt["bf16_rounded"]) else "are not the checkpoint's fp32 values"
            raise AssertionError(f"main parameters of the {' and '.join(kinds)} optimizer {what}")
    return rt.result


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """Every case in one world: ``{case: result}``."""
    return {name: run_case(name, ckpt_dir, patched, device=device) for name in names or CASES}


def one_chunk(rank, world_size, ckpt_dir, patched, device="cpu"):
    return run_case("one_chunk", ckpt_dir, patched, device=device)


def two_chunks(rank, world_size, ckpt_dir, patched, device="cpu"):
    return run_case("two_chunks", ckpt_dir, patched, device=device)
