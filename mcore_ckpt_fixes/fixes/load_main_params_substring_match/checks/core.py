"""load-main-params-substring-match's round trips: chained-optim-main-params-split's (a bf16 MoE GPT,
Megatron's DDP, ``get_megatron_optimizer``'s ``ChainedOptimizer``, the main parameters reloaded from
an fp32 legacy checkpoint with ``reload_model_params(state_dict=...)``; see that fix's
checks/core.py), with Megatron's ``TEGroupedMLP`` as the experts, 12 local experts per rank, on 2
gloo ranks:

* ``grouped_experts``: 12 experts, EP=1: one ``DistributedOptimizer`` holds every parameter, so
  the round trip needs no other fix (the scenario, and what tests/patches runs with every fix off);
* ``grouped_experts_ep2``: 24 experts, EP=2: a dense and an expert ``DistributedOptimizer``, each
  of which maps every parameter of the chunk (the expert one gets the checkpoint only with
  chained-optim-main-params-split on).

``TEGroupedMLP`` names one tensor per local expert (``linear_fc1.weight0`` .. ``weight11``): the
layout whose names are part of one another. It is Megatron's own class; only its two grouped
linear layers are stand-ins (:class:`GroupedLinear`), because Transformer Engine, whose
``GroupedLinear`` they are, cannot be installed on a CPU host. The optimizer sees of them what it
sees of TE's: one parameter per local expert under TE's names, marked expert-parallel as Megatron's
``TEGroupedLinear`` marks them. Checked on every rank: each sub-optimizer's fp32 main-parameter
shard equals the checkpoint's fp32 values (``max_delta``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ...chained_optim_main_params_split.checks import core as chained
from .. import ID, MODULE

LOCAL_EXPERTS = 12  # weight1 is part of weight10 and weight11


class GroupedLinear(torch.nn.Module):
    """Stand-in for Transformer Engine's ``GroupedLinear`` under Megatron's
    ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` (expert TP 1): ``weight{i}``
    of shape (output, input) per local expert, ``allreduce`` False under expert parallelism (what
    puts a parameter in the expert optimizer). Never run forward."""

    def __init__(self, num_gemms, input_size, output_size, *, config, is_expert=True, **kwargs):
        super().__init__()
        expert_parallel = config.expert_model_parallel_size > 1
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            weight.allreduce = not (is_expert and expert_parallel)
            self.register_parameter(f"weight{i}", weight)


def _submodules(spec):
    return spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules


def _with_submodules(spec, **changes):
    """``spec`` with some of its submodules replaced: a ModuleSpec, or a builder (a partial, 0.18.0 on)."""
    submodules = dataclasses.replace(_submodules(spec), **changes)
    if isinstance(spec, functools.partial):
        return functools.partial(spec.func, *spec.args, **dict(spec.keywords, submodules=submodules))
    return dataclasses.replace(spec, submodules=submodules)


def grouped_experts_spec(num_experts):
    """The local GPT layer spec with Megatron's ``TEGroupedMLP`` (grouped linears stood in) as experts."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe import experts
    from megatron.core.transformer.spec_utils import ModuleSpec

    layer = chained.local_moe_spec(num_experts)
    moe = _submodules(layer).mlp
    # From 0.17.0 TEGroupedMLP has its own submodules class and the experts are a builder (a partial).
    submodules = getattr(experts, "GroupedMLPSubmodules", MLPSubmodules)(
        linear_fc1=GroupedLinear, linear_fc2=GroupedLinear
    )
    if isinstance(_submodules(moe).experts, ModuleSpec):
        grouped = ModuleSpec(module=experts.TEGroupedMLP, submodules=submodules)
    else:
        grouped = functools.partial(experts.TEGroupedMLP, submodules=submodules)
    return _with_submodules(layer, mlp=_with_submodules(moe, experts=grouped))


CASES = {
    "grouped_experts": chained.Case(num_experts=LOCAL_EXPERTS, layer_spec=grouped_experts_spec),
    "grouped_experts_ep2": chained.Case(ep=2, num_experts=2 * LOCAL_EXPERTS, layer_spec=grouped_experts_spec),
}


def prepare() -> None:
    """Run in the parent before any world starts (every forked world starts warm)."""
    chained.prepare()
    import megatron.core.transformer.moe.experts  # noqa: F401


def run_case(name, ckpt_dir, patched, device="cpu"):
    return chained.run_case(name, ckpt_dir, patched, case=CASES[name], fix=(ID, MODULE), device=device)


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """Several cases in one world (``names``, default both): ``{case: result}``."""
    return {name: run_case(name, ckpt_dir, patched, device) for name in CASES if name in (names or CASES)}


def grouped_experts(rank, world_size, ckpt_dir, patched, device="cpu"):
    return run_case("grouped_experts", ckpt_dir, patched, device)
