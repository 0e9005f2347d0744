"""A user's Megatron job shrunk to what trains in seconds, everything else kept.

The release's own argument parser reads the job's arguments (an unknown option, or a value it
refuses, is the release's error). The plan (:func:`plan`) then changes only:

* the model's sizes: the fewest layers the pipeline layout allows (one per virtual stage; the MoE
  layer pattern sampled down, first and last layer kept), hidden size, heads, query groups, FFN and
  expert FFN sizes, MLA ranks and head sizes, experts (a multiple of EP, at least the router's
  top-k), sequence and vocabulary (the null tokenizer's);
* what a check does not need: data paths (mock data), tokenizer files, batch ramp-up, logging
  directories, sample-based lengths (iterations instead), the run's length and checkpoint directory;
* on a CPU host, Megatron's fused kernels that need CUDA (turned off, listed);

and names what cannot be kept on this host (Transformer Engine, fp8/fp4, flash attention, grouped
GEMM, context parallelism, a world that does not fit): the check goes on without it only with
``--allow-drop``. Parallel layout, precision, optimizer, scheduler style, checkpoint format and
options, rerun mode, MoE router and dispatcher, recompute and seed are the job's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
from dataclasses import dataclass, field
from typing import List, Optional

from ..testing.gpt_job import SEQ, VOCAB, run_options
from .own_args import unresolved

STEPS, SAVE_AT = 6, 3
HIDDEN_PER_HEAD = 8  # kv channels of the shrunk model; two heads per tensor-parallel rank
CPU_RANKS = 8  # the most ranks the check starts on a CPU host
FP16_INITIAL_SCALE = 4096  # --initial-loss-scale of a shrunk fp16 job (see _shrink_model)

# (dest, value on this host, why): Megatron's fused kernels a CPU host does not have. Turned off
# and listed; they compute what the unfused path computes.
CPU_KERNELS = (
    ("gradient_accumulation_fusion", False, "fused weight-gradient accumulation needs CUDA (Apex/TE)"),
    ("masked_softmax_fusion", False, "fused softmax is a CUDA kernel"),
    ("bias_gelu_fusion", False, "fused bias-GeLU is a CUDA kernel"),
    ("bias_swiglu_fusion", False, "fused bias-SwiGLU is a CUDA kernel"),
    ("bias_dropout_fusion", False, "fused bias-dropout-add is a CUDA kernel"),
    ("apply_rope_fusion", False, "fused RoPE is a CUDA kernel"),
    ("no_persist_layer_norm", True, "persistent LayerNorm is an Apex CUDA kernel"),
    ("cross_entropy_loss_fusion", False, "fused cross entropy is a CUDA kernel"),
    ("moe_permute_fusion", False, "fused MoE permutation is a Transformer Engine kernel"),
    ("moe_router_fusion", False, "fused MoE routing is a Transformer Engine kernel"),
    ("use_cpu_initialization", True, "weights are initialised on the CPU"),
)
# What the check leaves out: removed from the arguments, each with why.
NOT_NEEDED = {
    "data_path": "mock data",
    "train_data_path": "mock data",
    "valid_data_path": "mock data",
    "test_data_path": "mock data",
    "data_cache_path": "mock data",
    "data_args_path": "mock data",
    "per_split_data_args_path": "mock data",
    "split": "mock data",
    "tokenizer_model": "the null tokenizer",
    "vocab_file": "the null tokenizer",
    "merge_file": "the null tokenizer",
    "rampup_batch_size": "the check's batch is fixed",
    "train_samples": f"{STEPS} iterations",
    "lr_decay_samples": "iterations",
    "lr_warmup_samples": "iterations",
    "lr_wsd_decay_samples": "iterations",
    "exit_interval": f"the check stops at iteration {SAVE_AT} itself",
    "exit_duration_in_mins": f"the check stops at iteration {SAVE_AT} itself",
    "exit_signal_handler": f"the check stops at iteration {SAVE_AT} itself",
    "non_persistent_save_interval": "one checkpoint, a persistent one",
    "tensorboard_dir": "nothing is logged",
    "wandb_project": "nothing is logged",
    "wandb_exp_name": "nothing is logged",
    "wandb_save_dir": "nothing is logged",
    "pretrained_checkpoint": "the check resumes from its own checkpoint",
    "ckpt_step": "the check resumes from its own checkpoint",
    "save": "a fresh temporary directory",
    "load": "a fresh temporary directory",
    "save_interval": f"saved at iteration {SAVE_AT}",
    "train_iters": f"{STEPS} iterations",
}


@dataclass
class Change:
    option: str
    before: str
    after: str
    why: str
    kind: str  # "shrunk" (always), "host" (a CPU host's kernels), "dropped" (only with --allow-drop)


@dataclass
class Plan:
    argv: List[str]  # the shrunk job's arguments, without --save/--load/--train-iters/--save-interval
    world: int
    changes: List[Change] = field(default_factory=list)
    args: Optional[argparse.Namespace] = None  # the shrunk job's arguments as the release validated them

    def dropped(self) -> list:
        return [c for c in self.changes if c.kind == "dropped"]


def parser():
    """The release's own ``megatron.training`` argument parser (as ``parse_args`` builds it)."""
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False))


def parse(argv, world: int, validate: bool = True) -> argparse.Namespace:
    """The release parses (and validates, for ``world`` ranks) ``argv``; ValueError with its own
    last line where it refuses them."""
    from megatron.training import arguments

    err, out = io.StringIO(), io.StringIO()
    saved_env = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), _answering_as_a_gpu(arguments):
            args = parser().parse_args(argv)
            args.rank, args.world_size = 0, world
            if validate:
                arguments.validate_args(args, {})
    except SystemExit:
        said = [line for line in err.getvalue().splitlines() if line.strip()]
        raise ValueError(f"the release's parser refuses them: {said[-1] if said else 'exit'}") from None
    except (AssertionError, ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"the release's validate_args refuses them: {_said(exc)}") from None
    finally:
        if saved_env is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved_env
    return args


def _said(exc) -> str:
    """An exception in one line: its message, or for a bare ``assert`` the line that failed."""
    import traceback

    text = " ".join(str(exc).split())
    if text:
        return text
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{type(exc).__name__} at `{frames[-1].line}`" if frames else type(exc).__name__


@contextlib.contextmanager
def _answering_as_a_gpu(arguments):
    """On a host without CUDA, ``validate_args``' questions to the GPU (its architecture under TP > 1,
    its compute capability for grouped GEMM) answered as a current GPU would, for this call only:
    the job is validated as the GPU job it is; what this host cannot run is the plan's to name."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    saved_arch = getattr(arguments, "get_device_arch_version", None)
    saved_capability = torch.cuda.get_device_capability
    if saved_arch is not None:
        arguments.get_device_arch_version = lambda: 10
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved_capability
        if saved_arch is not None:
            arguments.get_device_arch_version = saved_arch


def groups(argv, table) -> list:
    """``argv`` as (option, dest, values): each option with the words its action takes."""
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        name, eq, inline = word.partition("=")
        action = table.get(name)
        if action is None:
            raise ValueError(f"{word!r} is not one of the release's options")
        i += 1
        if eq:
            out.append((name, action.dest, [inline]))
            continue
        take = _takes(action.nargs)
        values = []
        while i < len(argv) and len(values) < take and not _is_option(argv[i], table):
            values.append(argv[i])
            i += 1
        out.append((name, action.dest, values))
    return out


def _takes(nargs) -> float:
    if nargs is None or nargs == "?":
        return 1
    if isinstance(nargs, int):
        return nargs
    return math.inf  # "*", "+"


def _is_option(word, table) -> bool:
    return word.split("=", 1)[0] in table


def option_table(p) -> dict:
    # argparse keeps its option-to-action map private; it has been there since Python 2.7.
    return p._option_string_actions


class Plans:
    """Builds the argument list: the job's own groups, with some dests replaced."""

    def __init__(self, p, argv, parsed):
        self.parsed = parsed  # the job's arguments as the release parsed them
        self.table = option_table(p)
        self.defaults = {a.dest: a.default for a in self.table.values()}
        self.kept = groups(argv, self.table)
        self.added = {}
        self.changes = []

    def given(self, dest) -> bool:
        return any(d == dest for _, d, _ in self.kept)

    def set(self, dest, value, why, kind="shrunk", current=None):
        """Replace ``dest``'s options by ``value`` (None: removed; a bool: the flag saying it)."""
        if isinstance(value, bool):  # a switch: shown by its setting, named by its dest
            was = current if current is not None else getattr(self.parsed, dest, self.defaults.get(dest))
            if bool(was) != value:
                name = "--" + dest.replace("_", "-")
                self.changes.append(Change(name, _on_off(was), _on_off(value), why, kind))
        else:
            before = self._shown(dest, current)
            after = "(removed)" if value is None else str(value)
            if before != after:
                self.changes.append(Change(self._name(dest), before, after, why, kind))
        self.kept = [g for g in self.kept if g[1] != dest]
        self.added[dest] = value

    def _shown(self, dest, current):
        words = [" ".join(v) or "(set)" for _, d, v in self.kept if d == dest]
        if words:
            return words[-1]
        return "(default)" if current is None else f"{current} (default)"

    def _name(self, dest):
        names = [o for o, a in self.table.items() if a.dest == dest and o.startswith("--")]
        return names[0] if names else dest

    def argv(self) -> list:
        out = [w for option, _, values in self.kept for w in ([option] + list(values))]
        for dest, value in self.added.items():
            out += self._words(dest, value)
        return out

    def _words(self, dest, value) -> list:
        if value is None:
            return []
        if isinstance(value, bool):
            if self.defaults.get(dest) == value:
                return []
            flags = [o for o, a in self.table.items() if a.dest == dest and a.nargs == 0 and a.const == value]
            if not flags:
                raise ValueError(f"the release has no option that sets {dest} to {value}")
            return [sorted(flags, key=len)[0]]
        return [self._name(dest)] + (list(map(str, value)) if isinstance(value, (list, tuple)) else [str(value)])


def _on_off(value) -> str:
    return "on" if value else "off"


def world_for(tp, pp, cp, ep, etp) -> int:
    """The smallest world a layout runs on: PP stages of a multiple of TP x CP and of EP x expert TP."""
    return pp * math.lcm(tp * cp, ep * etp)


def plan(argv, nproc=None, device="cpu", host_ranks=None) -> Plan:
    """The shrunk job (module doc). ValueError, one line, for what the release refuses or for a
    world that cannot run (the job's layout on ``nproc`` ranks)."""
    p = parser()
    a = parse(argv, _world_of(parse(argv, 1, validate=False), nproc), validate=True)
    refused = _not_checkable(a)
    if refused:
        raise ValueError(refused)
    plans = Plans(p, argv, a)
    sizes = _layout(a)
    layout, world = _fit_layout(plans, sizes, nproc, device, host_ranks)
    _shrink_model(plans, a, layout)
    _leave_out(plans, a, layout, world)
    if device == "cpu":
        _cpu_host(plans, a)
    shrunk = plans.argv()
    marked = [w for w in shrunk if unresolved(w)]
    if marked:
        raise ValueError(
            f"{marked[0]!r}: the shell variable {unresolved(marked[0])} is not set; set it or edit the file"
        )
    try:
        shrunk_args = parse(shrunk + run_options("/nonexistent/mcore-ckpt-fixes-check", STEPS), world)
    except ValueError as exc:
        raise ValueError(f"the shrunk job is refused ({exc}); the job itself is valid: please report this") from None
    return Plan(argv=shrunk, world=world, changes=plans.changes, args=shrunk_args)


# (dest, why): what the check cannot train at all, whatever the host.
NOT_CHECKABLE = (
    ("use_legacy_models", "legacy (non-Megatron-Core) models"),
    ("use_megatron_fsdp", "Megatron-FSDP (the check trains with Megatron's DDP and distributed optimizer)"),
    ("use_custom_fsdp", "Megatron-FSDP (the check trains with Megatron's DDP and distributed optimizer)"),
    ("use_torch_fsdp2", "torch FSDP2 (the check trains with Megatron's DDP and distributed optimizer)"),
    ("hybrid_override_pattern", "hybrid (Mamba) models: the check trains GPT models"),
    ("spec", "a custom layer spec (--spec): the check builds the layers pretrain_gpt builds"),
)


def _not_checkable(a) -> str:
    for dest, what in NOT_CHECKABLE:
        if getattr(a, dest, None):
            return f"--{dest.replace('_', '-')}: {what} cannot be checked yet"
    return ""


def _world_of(a, nproc) -> int:
    """The world the job's own arguments are validated for: ``nproc`` where the layout fits it,
    else the smallest world of the layout (what the plan may then reduce is its own business)."""
    need = world_for(**_layout(a))
    return nproc if nproc and nproc % need == 0 else need


def _layout(a) -> dict:
    tp = a.tensor_model_parallel_size
    experts = bool(getattr(a, "num_experts", None))
    return {
        "tp": tp,
        "pp": a.pipeline_model_parallel_size,
        "cp": getattr(a, "context_parallel_size", 1) or 1,
        "ep": (getattr(a, "expert_model_parallel_size", 1) or 1) if experts else 1,
        "etp": (getattr(a, "expert_tensor_parallel_size", None) or tp) if experts else 1,
    }


def _fit_layout(plans, sizes, nproc, device, host_ranks):
    """The layout kept, or reduced (only with --allow-drop) until it fits this host; its world."""
    sizes = dict(sizes)
    if device == "cpu" and sizes["cp"] > 1:
        plans.set("context_parallel_size", 1, "context parallelism needs Transformer Engine's attention", "dropped")
        sizes["cp"] = 1
    need = world_for(**sizes)
    limit = host_ranks or nproc or (CPU_RANKS if device == "cpu" else _gpus())
    if need <= limit:
        if nproc and nproc % need:
            raise ValueError(
                f"--nproc {nproc} does not fit the job's layout ({_shown_layout(sizes)}): use a multiple of {need}"
            )
        return sizes, nproc or need
    world = need
    before = _shown_layout(sizes)
    while world_for(**sizes) > limit:
        dim = max(("ep", "pp", "tp", "etp", "cp"), key=lambda d: sizes[d])
        sizes[dim] = sizes[dim] // 2 if sizes[dim] % 2 == 0 else 1
        if dim == "tp" and sizes["etp"] > sizes["tp"]:
            sizes["etp"] = sizes["tp"]
    for dim, dest in (
        ("tp", "tensor_model_parallel_size"),
        ("pp", "pipeline_model_parallel_size"),
        ("ep", "expert_model_parallel_size"),
        ("etp", "expert_tensor_parallel_size"),
    ):
        if plans.given(dest) or dim in ("tp", "pp"):
            plans.set(dest, sizes[dim], f"{before} needs {world} ranks; the check runs {limit} here", "dropped")
    return sizes, world_for(**sizes)


def _shown_layout(sizes) -> str:
    return " x ".join(f"{k.upper()}={v}" for k, v in sizes.items() if v > 1) or "one rank"


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _vpp(a) -> int:
    if getattr(a, "num_virtual_stages_per_pipeline_rank", None):
        return a.num_virtual_stages_per_pipeline_rank
    return a.virtual_pipeline_model_parallel_size or 1


def _shrink_model(plans, a, layout):
    tp, pp, vpp = layout["tp"], layout["pp"], _vpp(a)
    pattern = _moe_pattern(a)
    layers = pp * vpp * (2 if pattern and len(set(pattern)) > 1 and pp * vpp < 2 else 1)
    plans.set("num_layers", layers, "one layer per (virtual) pipeline stage")
    if plans.given("num_layers_per_virtual_pipeline_stage"):
        plans.set("num_layers_per_virtual_pipeline_stage", 1, "one layer per virtual stage")
    for dest in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if getattr(a, dest, None):
            plans.set(dest, layers // (pp * vpp) * vpp, "one layer per virtual stage")
    if pattern:
        plans.set("moe_layer_freq", _sampled(pattern, layers), "the job's MoE layer pattern, sampled down")
    heads = 2 * tp
    hidden = heads * HIDDEN_PER_HEAD
    plans.set("hidden_size", hidden, "small")
    plans.set("num_attention_heads", heads, "two heads per TP rank")
    plans.set("ffn_hidden_size", 2 * hidden, "small")
    if plans.given("kv_channels"):
        plans.set("kv_channels", HIDDEN_PER_HEAD, "small")
    if a.group_query_attention:
        plans.set("num_query_groups", tp, "one query group per TP rank")
    _shrink_moe(plans, a, layout, hidden)
    if getattr(a, "multi_latent_attention", False):
        for dest, value in (
            ("q_lora_rank", 16),
            ("kv_lora_rank", 16),
            ("qk_head_dim", 8),
            ("qk_pos_emb_head_dim", 8),
            ("v_head_dim", 8),
        ):
            if getattr(a, dest, None):
                plans.set(dest, value, "small")
    plans.set("seq_length", SEQ, "small")
    plans.set("max_position_embeddings", SEQ, "small")
    if getattr(a, "decoder_seq_length", None):
        plans.set("decoder_seq_length", SEQ, "small")
    plans.set("tokenizer_type", "NullTokenizer", "mock data")
    plans.set("vocab_size", VOCAB, "the null tokenizer's vocabulary, small")
    if a.fp16 and a.loss_scale is None and not plans.given("initial_loss_scale"):
        # The dynamic scale starts at 2**32, and a tiny model's first steps all overflow at it:
        # six steps would save before the first update, which the release cannot load back
        # (its optimizer has no state yet; catalogued). Long jobs pass that point early.
        plans.set(
            "initial_loss_scale",
            FP16_INITIAL_SCALE,
            "the first steps update (a long job's scale has come down by then)",
            current=a.initial_loss_scale,
        )
    if a.recompute_num_layers and a.recompute_num_layers > 1:
        plans.set("recompute_num_layers", 1, "one layer per stage")


def _moe_pattern(a):
    """The job's MoE layer pattern (1 MoE, 0 dense) over its layers, or None for a dense job."""
    if not getattr(a, "num_experts", None):
        return None
    freq = a.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(a.num_layers)]
    return list(freq)


def _sampled(pattern, n) -> str:
    """``pattern`` sampled at ``n`` layers, first and last kept, as the option's list syntax."""
    picked = [pattern[round(i * (len(pattern) - 1) / max(n - 1, 1))] for i in range(n)]
    return "[" + ",".join(map(str, picked)) + "]"


def _shrink_moe(plans, a, layout, hidden):
    if not getattr(a, "num_experts", None):
        return
    ep, topk = layout["ep"], a.moe_router_topk
    experts = ep * math.ceil(max(topk, 2) / ep)
    groups = getattr(a, "moe_router_num_groups", None)
    if groups:
        group_topk = a.moe_router_group_topk or groups
        groups = math.gcd(groups, experts) if experts % min(groups, experts) else min(groups, experts)
        plans.set("moe_router_num_groups", groups, "groups of the shrunk experts")
        plans.set("moe_router_group_topk", min(group_topk, groups), "groups of the shrunk experts")
    plans.set("num_experts", experts, "a multiple of EP, at least the router's top-k")
    plans.set("moe_ffn_hidden_size", 2 * hidden, "small")
    if getattr(a, "moe_shared_expert_intermediate_size", None):
        plans.set("moe_shared_expert_intermediate_size", 2 * hidden, "small")


def _leave_out(plans, a, layout, world):
    for dest, why in NOT_NEEDED.items():
        if plans.given(dest):
            plans.set(dest, None, why)
    if "mock_data" in plans.defaults:
        plans.set("mock_data", True, "mock data")
    dp = world // (layout["tp"] * layout["pp"] * layout["cp"])
    microbatches = 1 if layout["pp"] == 1 else 2 * layout["pp"]
    plans.set("micro_batch_size", 1, "small")
    plans.set("global_batch_size", dp * microbatches, f"{microbatches} micro-batch(es) per data-parallel rank")
    if a.lr_decay_iters or plans.given("lr_decay_samples"):
        plans.set("lr_decay_iters", STEPS, "the check's length")
    if a.lr_warmup_iters or plans.given("lr_warmup_samples"):
        plans.set("lr_warmup_iters", 1, "the check's length")
    if getattr(a, "lr_wsd_decay_iters", None) or plans.given("lr_wsd_decay_samples"):
        plans.set("lr_wsd_decay_iters", 2, "the check's length")
    if getattr(a, "mtp_num_layers", None):
        plans.set("mtp_num_layers", None, "multi-token prediction layers are not built by the check", "dropped")
    if a.finetune:
        plans.set("finetune", False, "--finetune starts a new run; the check resumes its own checkpoint", "dropped")


def _local_attention_has_mla() -> bool:
    """Whether Megatron's local ``DotProductAttention`` takes MLA's separate key and value head sizes."""
    import inspect

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return "k_channels" in inspect.signature(DotProductAttention.__init__).parameters


def _cpu_host(plans, a):
    if a.transformer_impl != "local":
        plans.set("transformer_impl", "local", "Transformer Engine needs a GPU", "dropped", a.transformer_impl)
    for dest, why in (
        ("fp8", "fp8 needs Transformer Engine on a GPU"),
        ("fp4", "fp4 needs Transformer Engine on a GPU"),
    ):
        if getattr(a, dest, None):
            plans.set(dest, None, why, "dropped")
    if getattr(a, "use_flash_attn", False):
        plans.set("use_flash_attn", False, "flash attention needs a GPU", "dropped")
    if getattr(a, "moe_grouped_gemm", False):
        plans.set("moe_grouped_gemm", False, "grouped GEMM needs a GPU", "dropped")
    if getattr(a, "tp_comm_overlap", False):
        plans.set("tp_comm_overlap", False, "TP communication overlap needs Transformer Engine", "dropped")
    if getattr(a, "moe_token_dispatcher_type", "") == "flex":
        plans.set("moe_token_dispatcher_type", "alltoall", "the flex dispatcher needs DeepEP on a GPU", "dropped")
    if getattr(a, "multi_latent_attention", False) and not _local_attention_has_mla():
        plans.set(
            "multi_latent_attention",
            False,
            "this release's local attention has no MLA path (it needs Transformer Engine)",
            "dropped",
        )
    backend = getattr(a, "attention_backend", None)
    if backend is not None and getattr(backend, "name", "auto") not in ("auto", "local", "unfused"):
        plans.set("attention_backend", "auto", f"the {backend.name} attention backend needs a GPU", "dropped")
    for dest, value, why in CPU_KERNELS:
        if dest in plans.defaults and getattr(a, dest, value) != value:
            plans.set(dest, value, why, "host", getattr(a, dest))
