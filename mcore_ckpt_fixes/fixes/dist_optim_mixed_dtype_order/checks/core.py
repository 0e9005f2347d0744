"""dist-optim-mixed-dtype-order's round trips: Megatron's DDP and distributed optimizer (Adam on the
path Megatron takes with Apex installed, :mod:`mcore_ckpt_fixes.testing._fused_adam`'s CPU stand-in) with fp32 parameters beside bf16 ones in one parameter group, saved and loaded with
``dist_checkpointing`` on 2 gloo ranks. Two cases (``CASES``), in one world:

* ``gpt``: a one-layer bf16 GPT (local spec) not wrapped in ``Float16Module``, so torch's
  ``LayerNorm`` keeps its norms fp32 (and the position embedding is fp32); DP=2. Saved as
  ``dp_reshardable`` (Megatron-LM's default) after ``STEPS`` steps, loaded into a target run (other
  initial values, one step taken) with the same layout, then one more step on both.
* ``equal_sizes``: six parameters of one shape, two bf16 then four fp32 (``DTYPES``), so every
  parameter the release mis-pairs is paired with a shard of its own size and the save raises
  nothing. Saved as ``fully_reshardable`` with DP=2 and loaded with DP=1 (tensor-parallel size 2 over
  the same two ranks; no parameter is split by it), where the release pairs other parameters.

What is compared, on every rank: each parameter's whole main value and Adam moments (each rank's
shard put in place and summed over the data-parallel group), paired as training pairs them, through
the distributed optimizer's model and shard groups (not through the map under test), against what
was saved, and after the next step against the uninterrupted run's (``next/``). ``mispaired``: the
parameters of this rank whose map entry (``model_param_group_index_map``) names another shard than
their own. In ``equal_sizes`` a loaded value that is another parameter's saved one fails the round
trip with ``SWAPPED`` (``swapped``: parameter -> whose state it got).

What is not real: the gradients (drawn, the same on every rank), Apex's FusedAdam (a stand-in in
plain torch ops, on the models' device) and, on a CPU host, the CUDA tensors, as
:mod:`mcore_ckpt_fixes.testing.dist_optimizer` says (``device="cuda"`` puts the models on the GPU).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ....testing._fused_adam import optimizer_path
from ....testing.dist_optimizer import (
    SOURCE_SEED,
    distributed,
    optimizer_config,
    request,
    sharding_type,
    step,
    values,
    world,
)
from ....testing.dist_optimizer import device as world_device

# The scenarios' prepare (warm imports in the parent before any world forks).
from ....testing.dist_optimizer import prepare  # noqa: F401
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE

STEPS = 3
TARGET_SEED = 98765
CASES = {"gpt": "dp_reshardable", "equal_sizes": "fully_reshardable"}
DTYPES = (torch.bfloat16,) * 2 + (torch.float32,) * 4  # equal_sizes' parameters, in this order
SHAPE = (16, 64)  # 1024 elements: with DP=2 each rank owns whole parameters
KINDS = ("main", "exp_avg", "exp_avg_sq")
SWAPPED = "AssertionError: parameters loaded other parameters' main values and optimizer state"


def _config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=2,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
    )


def _module(case, config, seed):
    """The case's model (no ``Float16Module``: its fp32 parameters stay fp32)."""
    if case == "gpt":
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        module = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8)
    else:
        from megatron.core.transformer.module import MegatronModule

        module = MegatronModule(config)
        for i, dtype in enumerate(DTYPES):
            module.register_parameter(f"w{i}", torch.nn.Parameter(torch.zeros(SHAPE, dtype=dtype)))
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(values(seed, "param", name, shape=p.shape))
    return module.to(world_device())


def build(case, seed):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer

    config = _config()
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True), _module(case, config, seed)
    )
    return model, get_megatron_optimizer(optimizer_config(), [model])


def _own_shards(d):
    """{model parameter: its main shard}, as training pairs them (model and shard groups)."""
    pairs = {}
    groups = ((d.model_float16_groups, d.shard_fp32_from_float16_groups), (d.model_fp32_groups, d.shard_fp32_groups))
    for model_groups, shard_groups in groups:
        for params, shards in zip(model_groups, shard_groups):
            pairs.update(zip(params, shards))
    return pairs


def mispaired(model, opt):
    """This rank's parameters whose map entry names another shard than their own."""
    out = []
    for d in distributed(opt):
        own = _own_shards(d)
        for name, p in model.module.named_parameters():
            if p in own:
                group, order = d.model_param_group_index_map[p]
                if d.optimizer.param_groups[group]["params"][order] is not own[p]:
                    out.append(name)
    return out


def full_state(model, opt):
    """Every parameter's whole main value and Adam moments, the same on every rank of the
    data-parallel group, paired through the model and shard groups."""
    from megatron.core import parallel_state

    out = {f"{k}/{n}": torch.zeros(p.numel()) for n, p in model.module.named_parameters() for k in KINDS}
    for d in distributed(opt):
        own = _own_shards(d)
        for name, p in model.module.named_parameters():
            if p not in own:
                continue
            span = d._get_model_param_range_map(p)["param"]
            shard = own[p]
            local = {"main": shard, **{k: v for k, v in d.optimizer.state[shard].items() if k != "step"}}
            for kind in KINDS:
                out[f"{kind}/{name}"][span.start : span.end] = local[kind].detach().float().view(-1)
    group = parallel_state.get_data_parallel_group()
    for key in sorted(out):
        dist.all_reduce(out[key], group=group)
    return out


def swapped(saved, got):
    """{parameter: the other parameter whose saved main value and moments it got}."""
    names = sorted({k.split("/", 1)[1] for k in saved})
    out = {}
    for name in names:
        for other in names:
            same = all(torch.equal(got[f"{k}/{name}"], saved[f"{k}/{other}"]) for k in KINDS)
            if other != name and same:
                out[name] = other
    return out


def _save(rt, case, path):
    """The source run in the data-parallel layout of the world: (saved, reference)."""
    from megatron.core import dist_checkpointing

    model, opt = build(case, SOURCE_SEED)
    for i in range(STEPS):
        step(model, opt, i)
    rt["mispaired"] = mispaired(model, opt)
    rt.phase("save")
    dist_checkpointing.save(request(model, opt, sharding_type(CASES[case]), False), path)
    saved = full_state(model, opt)
    step(model, opt, STEPS)
    return saved, full_state(model, opt)


def _load(rt, case, path):
    from megatron.core import dist_checkpointing

    model, opt = build(case, TARGET_SEED)
    step(model, opt, 100)
    rt.phase("load")
    loaded = dist_checkpointing.load(request(model, opt, sharding_type(CASES[case]), True), path)
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    rt["mispaired_target"] = mispaired(model, opt)
    got = full_state(model, opt)
    step(model, opt, STEPS)
    return got, full_state(model, opt)


def run_case(case, ckpt_dir, patched, device="cpu"):
    """One case: its RoundTrip result (the world's parallel state is set up here, the models on ``device``)."""
    rt = RoundTrip(case=case, sharding_type=CASES[case])
    path = os.path.join(ckpt_dir, case)
    # Apex's FusedAdam (its CPU stand-in): the path of a GPU host, where the step is kept per group
    # (torch's Adam would need torch-adam-step to load, and tests/patches runs with every fix off).
    with rt.running(), optimizer_path(apex=True):
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        with world(device):
            rt["device"] = str(world_device())
            rt.phase("train")
            saved, reference = _save(rt, case, path)
            if case == "gpt":
                got, after = _load(rt, case, path)
        if case == "equal_sizes":  # loaded with DP=1: the release pairs other parameters there
            with world(device, tensor_model_parallel_size=2):
                got, after = _load(rt, case, path)
        rt.compare(saved, got)
        rt.compare(reference, after, prefix="next/")
        rt["swapped"] = swapped(saved, got)
        if rt["swapped"]:
            rt.fail(SWAPPED)
    return rt.result


def next_step_comparable():
    """None, or why the round trip cannot judge this release: on 0.12.x the step after the load at
    DP=1 differs from the uninterrupted DP=2 run's in the last bits (2e-7 in the main values) with
    the fix on too, though every loaded value is exact: the step's gradient clipping (clip_grad 1.0)
    sums the gradient norm in another order under the other layout there (with clip_grad 0 the
    next step is exact too). The comparison is not loosened for it."""
    import megatron.core
    from packaging.version import Version

    if Version(megatron.core.__version__) < Version("0.13.0"):
        return (
            "0.12's gradient clipping sums the norm in another order after a load at another data-parallel "
            "size, so the next step is not bitwise the uninterrupted run's"
        )
    return None


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """Several cases in one world (``names``, default both): ``{case: result}``."""
    return {case: run_case(case, ckpt_dir, patched, device) for case in CASES if case in (names or CASES)}


def equal_sizes(rank, world_size, ckpt_dir, patched, device="cpu"):
    """``selftest``'s scenario: the silent swap alone."""
    return run_case("equal_sizes", ckpt_dir, patched, device)
