"""expert-keys: every expert-parallel rank writes its experts under their global index (fsdp_dtensor).

Affected: Megatron-Core 0.16.0 - 0.19.2 (not fixed upstream at the time of writing). Upstream code:
``handle_experts_in_state_dict`` / ``expert_param_local_key`` / ``get_expert_index_from_key`` in
``megatron/core/transformer/fsdp_dtensor_checkpoint.py`` (NVIDIA/Megatron-LM, the Megatron-FSDP
``fsdp_dtensor`` checkpoint format); bound by name in ``megatron.training.checkpointing`` (0.17+, and
Megatron-LM checkouts) and ``megatron.core.optimizer.distrib_optimizer`` (optimizer state names).

Failures prevented, for ``fsdp_dtensor`` checkpoints under expert parallelism (EP > 1):

* TE grouped experts keep their biases as ``...mlp.experts.linear_fc1.bias{i}`` /
  ``linear_fc2.bias{i}`` with the *local* index ``i``. Upstream renames ``weight{i}`` to the global
  expert index but not ``bias{i}``, so every EP rank writes the same bias keys (model and optimizer
  state), DCP keeps one rank's copy, and on load the other EP ranks get that rank's expert biases:
  silently wrong, no error.
* ``num_experts=None`` with expert keys present: upstream "renames" each key to itself and then
  deletes it, so every expert tensor silently vanishes from the checkpoint. Now one clear
  ``ValueError`` naming the key and what is accepted.
* An un-indexed single grouped tensor (``moe_single_grouped_weight`` / ``_bias``, 0.18+:
  ``...linear_fc1.weight``, shape ``(num_local_experts, ...)``) trips ``AssertionError: Failed to
  parse expert index from key`` (weights), or is written by every EP rank under the same key and
  offsets (a grouped bias beside indexed weights: EP ranks silently load one rank's biases). It
  carries no index to rename: its expert index is its position on dim 0. With EP = 1 it is already
  global and kept as is. With EP > 1 the key is kept and the *tensor* is described as EP rank r's
  slice of the global ``(num_experts, ...)`` tensor, rows ``r * num_local ...``:
  ``handle_grouped_experts_in_state_dict`` runs after Megatron-FSDP's uneven-DTensor preprocessing
  (it reads the chunk that step computed over the expert-data-parallel mesh and shifts it by the EP
  block; no collective), for model and optimizer state alike. The value in the checkpointed dict is
  a new DTensor over the same storage (a load lands in the parameter), with the global shape; the
  nested dicts on its path are copies, so the dicts Megatron keeps (``raw_optimizer_state_dict``)
  still hold the parameter-shaped DTensors. Hooks: ``megatron.training.checkpointing``'s and
  Megatron-Bridge's (``megatron.bridge.training.checkpointing``, whose
  ``preprocess_fsdp_dtensor_state_dict`` runs before every Bridge fsdp_dtensor save and load)
  bindings of ``preprocess_state_dict_for_uneven_dtensor``; other callers (a script of one's own)
  call ``megatron.core.transformer.fsdp_dtensor_checkpoint.handle_grouped_experts_in_state_dict``
  (with the source diff) or ``mcore_ckpt_fixes.fixes.expert_keys.handle_grouped_experts_in_state_dict``
  after their own preprocessing. (Megatron-FSDP's own ``fully_shard`` path, which binds the
  function too, has no expert parallelism and is left alone; NeMo 2's ``MegatronStrategy`` in
  nemo-toolkit <= 2.7 never calls ``handle_experts_in_state_dict`` at all and is not covered;
  nemo-toolkit 3.0 has no such strategy.) SwiGLU halves of a grouped tensor (``weight_w``) under EP > 1 are
  refused with one ``ValueError``.

How: the three module-level functions are replaced (the engine rebinds them in every module that
imported them by name). Keys are parsed once by two patterns (TE grouped ``weight|bias`` with an
optional index and SwiGLU ``_w`` / ``_v`` suffix; SequentialMLP ``local_experts.{i}.``); an index is
made global (``i + ep_rank * num_local_experts``) or local again by rebuilding the key from its
parts, not by ``str.replace`` (which also hit ``weight1`` inside ``weight10``). Keys already carrying
this rank's global index are kept, as upstream does, so applying the renaming twice is harmless.

Loading a checkpoint an unfixed release wrote under EP > 1 (never silently): its expert biases are
stored under local indices (``...linear_fc1.bias0``, written by every EP rank, one copy kept), and
with the fix EP ranks > 0 ask for global keys (``bias2``, ``bias3``) that are not there; Megatron's
partial fsdp_dtensor load (the default; ``--strict-fsdp-dtensor-load`` fails on them instead) skips
missing keys with an info-level log. ``print_diff_in_state_dicts``, which
``megatron.training.checkpointing._load_base_checkpoint`` calls with the checkpoint's DCP metadata
and the state dict about to be loaded just before a partial load, is wrapped: after upstream's log it
looks at the metadata's keys (no tensor data) and, if expert biases carry fewer, lower indices than
the expert weights, emits a ``MegatronPatchWarning`` naming the old layout and the keys this rank
will not find (those tensors keep their current values). Ranks whose bias keys are present (EP rank
0) load the one saved copy, the best state there is, and are told it may be another EP rank's.
Single grouped tensors in the old layout (stored ``(n, ...)``, asked for as ``(ep * n, ...)``, which
DCP would refuse as a size mismatch) are handled the same way by pointing the request at what is
stored: EP rank 0 reads the one copy, the other EP ranks drop the tensor from the load and keep their
values, each with a warning (``align_old_grouped_expert_layout``). This load side is
monkeypatch-only: patches/expert-keys/ replaces the key functions and the preprocessing binding and
does not touch ``print_diff_in_state_dicts``, so a source-patched install loads such checkpoints
without it (bias keys: silently partial; grouped tensors: DCP's size-mismatch error).
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "expert-keys"
MODULE = "megatron.core.transformer.fsdp_dtensor_checkpoint"
NAMES = ("get_expert_index_from_key", "handle_experts_in_state_dict", "expert_param_local_key")
# Modules known to bind these names with ``from ... import`` (the engine rebinds every loaded module).
ALIAS_SITES = ("megatron.training.checkpointing", "megatron.core.optimizer.distrib_optimizer")
# Its fsdp_dtensor save and load call Megatron-FSDP's uneven-DTensor preprocessing through this name;
# only this binding is replaced (Megatron-FSDP's own fully_shard path has no expert parallelism).
TRAINING = "megatron.training.checkpointing"
UNEVEN = "megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor"
# Megatron-Bridge's ``preprocess_fsdp_dtensor_state_dict`` (its fsdp_dtensor save and load) calls the
# same preprocessing through its own binding, imported by name when Bridge is: replaced there too.
# Gated by Megatron-Core's version: the missing grouped handling is Megatron-Core's.
BRIDGE = "megatron.bridge.training.checkpointing"
# NeMo 2's strategy (nemo-toolkit < 3.0) preprocesses fsdp_dtensor checkpoints itself and never calls
# handle_experts_in_state_dict: not covered; declared so that status says so where NeMo is installed
# (nemo-toolkit 3.0 has no such module: not applicable).
NEMO = "nemo.lightning.pytorch.strategies.megatron_strategy"

_RUNTIME = f"{__name__}.runtime"
_PATCH = f"{_RUNTIME}.core"

FIX = Fix(
    id=ID,
    summary="fsdp_dtensor expert biases get global indices under EP; num_experts=None and grouped tensors handled",
    affected=">=0.16.0,<=0.19.2",
    upstream=(
        "not fixed upstream as of Megatron-Core 0.19.2: megatron/core/transformer/fsdp_dtensor_checkpoint.py "
        "handle_experts_in_state_dict renames expert weights only",
        "NVIDIA/Megatron-LM#6600 (closest upstream issue: EP with single grouped [E_local, ...] expert tensors "
        "under Megatron-FSDP v2, the grouped-tensor part only; it does not cover fsdp_dtensor's expert keys)",
    ),
    targets=(
        Target(MODULE, f"{_PATCH}:probe", f"{_PATCH}:apply", alias_sites=ALIAS_SITES),
        Target(TRAINING, f"{_PATCH}:probe_training", f"{_PATCH}:apply_training"),
        Target(BRIDGE, f"{_RUNTIME}.bridge:probe_bridge", f"{_RUNTIME}.bridge:apply_bridge"),
        Target(
            NEMO,
            f"{_RUNTIME}.nemo:probe_nemo",
            f"{_RUNTIME}.nemo:apply_nemo",
            package="nemo-toolkit",
            affected="<3.0.0",
        ),
    ),
)


def __getattr__(name):
    # handle_grouped_experts_in_state_dict is the documented entry point for callers that run the
    # uneven-DTensor preprocessing themselves (docs/fixes/expert-keys.md, docstring above): resolved on first use, so
    # that importing the declaration imports none of the implementation.
    if name == "handle_grouped_experts_in_state_dict":
        from .runtime.keys import handle_grouped_experts_in_state_dict

        return handle_grouped_experts_in_state_dict
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
