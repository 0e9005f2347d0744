"""fsdp-dtensor-pp-guard in Megatron-Bridge's own checkpointing (``megatron.bridge.training.checkpointing``).

Bridge 0.6.2 keeps its own fsdp_dtensor save and load. Its keys are the model's
``state_dict_for_save_checkpoint()`` names under ``model`` (``_generate_model_state_dict``), stage-local
like Megatron-LM's; its ``preprocess_fsdp_dtensor_state_dict`` (save and load) applies Megatron-Core's
fp8 / SwiGLU / GDN / expert / uneven-DTensor steps and nothing that renames layers. Its
``_load_checkpoint_from_path`` reads the checkpoint's ``run_config.yaml`` in the fsdp_dtensor branch,
compares (TP, PP) with the run's only to skip the RNG state, and loads anyway: with another pipeline
layout every later stage loads the first stage's layers, silently.

The guard: ``_load_checkpoint_from_path`` (wrapped; ``setup.py`` binds it by name) marks, for the
length of the call, that an fsdp_dtensor load of this run's config is under way (a context variable);
the module's binding of ``read_run_config`` (wrapped: the release's own read, which every rank
makes, nothing read twice) then compares the checkpoint's pipeline layout with the run's and raises
one ``ValueError`` naming both and the remedy, before the DCP metadata or any tensor is read. Other
formats, other callers of ``read_run_config`` and a checkpoint without ``run_config.yaml`` (nothing
to compare with) are left alone.
"""

from __future__ import annotations

import contextvars
import os
import types

from ....engine.layers import layer
from ....engine.patching import Patcher, original
from ....engine.probing import in_scope, module_scope
from .. import ID

MODULE = "megatron.bridge.training.checkpointing"
ENTRY = "_load_checkpoint_from_path"
READ = "read_run_config"

# The run config of the fsdp_dtensor load under way in this context (None: none is).
_FSDP_DTENSOR_LOAD = contextvars.ContextVar("fsdp_dtensor_pp_guard_bridge_load", default=None)

# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/bridge/training/checkpointing.py, above _load_checkpoint_from_path.

# What decides which global layers a pipeline stage holds (the model config's fields, as
# run_config.yaml records them): an fsdp_dtensor checkpoint names each layer by its index within its
# stage, so these must be the ones it was saved with.
_FSDP_DTENSOR_LAYOUT_FIELDS = (
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def _fsdp_dtensor_layout_value(name, value):
    """A layout field's value in one spelling: a pipeline_model_parallel_layout (the config's object,
    or the string or list run_config.yaml holds) as its rows of layer type names."""
    if name != "pipeline_model_parallel_layout" or value is None:
        return value
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    value = getattr(value, "input_data", value)
    if isinstance(value, str):
        value = PipelineParallelLayerLayout.parse_str_to_list(value)
    return [[getattr(t, "name", t) for t in row] for row in value]


def _refuse_fsdp_dtensor_pipeline_change(run_config, model_config, checkpoint_name):
    """Raise if the fsdp_dtensor checkpoint's run config lays the layers out over the pipeline
    otherwise than ``model_config``: each stage would load another stage's layers."""
    saved = run_config.get("model") if isinstance(run_config, dict) else None
    if not isinstance(saved, dict) or "megatron_mimo_parallelism_config" in saved:
        return
    changed = []
    for name in _FSDP_DTENSOR_LAYOUT_FIELDS:
        if name not in saved or not hasattr(model_config, name):
            continue
        old, new = saved[name], getattr(model_config, name)
        try:
            same = _fsdp_dtensor_layout_value(name, old) == _fsdp_dtensor_layout_value(name, new)
        except Exception:  # a layout this release cannot read: not this check's to refuse
            same = True
        if not same:
            changed.append((name, getattr(old, "input_data", old), getattr(new, "input_data", new)))
    if changed:
        saved_layout = ", ".join(f"{name}={old}" for name, old, _ in changed)
        run_layout = ", ".join(f"{name}={new}" for name, _, new in changed)
        raise ValueError(
            f"{checkpoint_name}: this fsdp_dtensor checkpoint names each transformer layer by its index "
            f"within its pipeline stage and was saved with {saved_layout}; this run has {run_layout}, "
            f"so its stages would load other stages' layers without an error. Resume it with the "
            f"pipeline layout it was saved with (or convert it to torch_dist with that layout first: "
            f"torch_dist names layers by their global number)"
        )


# -- end of replacement ---


def _run_config(args, kwargs):
    """The ``ConfigContainer`` of the run ``_load_checkpoint_from_path`` was called for, if it is an
    fsdp_dtensor load (the release takes that branch from ``cfg.checkpoint.ckpt_format``)."""
    import inspect

    try:
        bound = inspect.signature(original(MODULE, ENTRY)).bind(*args, **kwargs)
    except TypeError:
        return None
    cfg = getattr(bound.arguments.get("state"), "cfg", None)
    fmt = getattr(getattr(cfg, "checkpoint", None), "ckpt_format", None)
    return cfg if fmt == "fsdp_dtensor" and getattr(cfg, "model", None) is not None else None


@layer(ID, MODULE, ENTRY)
def _load_checkpoint_from_path(below_us, *args, **kwargs):
    """Bridge's ``_load_checkpoint_from_path``; an fsdp_dtensor load of it checks the checkpoint's
    run config as the release reads it (:func:`read_run_config`)."""
    cfg = _run_config(args, kwargs)
    if cfg is None:
        return below_us(*args, **kwargs)
    token = _FSDP_DTENSOR_LOAD.set(cfg)
    try:
        return below_us(*args, **kwargs)
    finally:
        _FSDP_DTENSOR_LOAD.reset(token)


@layer(ID, MODULE, READ)
def read_run_config(below_us, run_config_filename, *args, **kwargs):
    """The checkpointing module's ``read_run_config``: within an fsdp_dtensor load, the run config it
    read (every rank reads it: rank 0 from the file, broadcast) is compared with the run's layout."""
    run_config = below_us(run_config_filename, *args, **kwargs)
    cfg = _FSDP_DTENSOR_LOAD.get()
    if cfg is not None:
        _refuse_fsdp_dtensor_pipeline_change(run_config, cfg.model, os.path.dirname(str(run_config_filename)))
    return run_config


# -- probe: Bridge's own fsdp_dtensor preprocessing of a later stage's layer -------------------------


def keeps_stage_local_layer_names(module) -> bool:
    """Does Bridge's ``preprocess_fsdp_dtensor_state_dict`` (what its fsdp_dtensor save and load run
    on the state dict) hand a layer on under the model's own, stage-local, name? Run in a copy of the
    module's globals with Megatron-FSDP's uneven-DTensor step (a collective) and the fp8 / GDN steps
    made no-ops, on a stand-in model of a dense (non-SwiGLU, no experts) config."""
    names = {
        "preprocess_state_dict_for_uneven_dtensor": lambda *a, **k: None,
        "handle_fp8_extra_state_case": lambda *a, **k: None,
        "handle_gdn_in_state_dict": None,
    }
    preprocess = in_scope(original(module, "preprocess_fsdp_dtensor_state_dict"), module_scope(module, **names))
    config = types.SimpleNamespace(gated_linear_unit=False, activation_func=None, num_moe_experts=None)
    key = "decoder.layers.0.mlp.linear_fc2.weight"
    out = preprocess(None, {"model": {key: None}}, types.SimpleNamespace(config=config))
    return key in out["model"]


def probe(module: types.ModuleType):
    needed = (ENTRY, READ, "preprocess_fsdp_dtensor_state_dict", "load_fsdp_dtensor_checkpoint")
    missing = [n for n in needed if n not in module.__dict__]
    if missing:
        return None, f"{MODULE} has no fsdp_dtensor load ({', '.join(missing)} absent)"
    if not module.__dict__.get("HAVE_MEGATRON_FSDP", False):
        return None, "Megatron-FSDP is not importable: Bridge's fsdp_dtensor load refuses to run"
    if not keeps_stage_local_layer_names(module):
        return False, "Bridge's fsdp_dtensor state dicts name a later stage's layers by their global number"
    if callable(module.__dict__.get("_refuse_fsdp_dtensor_pipeline_change")):
        # A source carrying this guard's diff (patches/fsdp-dtensor-pp-guard/megatron-bridge-*.patch).
        return False, "Bridge's fsdp_dtensor load refuses a checkpoint of another pipeline layout"
    return True, (
        "Bridge's fsdp_dtensor checkpoints name each layer by its index within its pipeline stage, and "
        "its load compares (TP, PP) only to skip the RNG state"
    )


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    # replace_function: setup.py binds _load_checkpoint_from_path by name (the PEFT base model load).
    patcher.replace_function(module, ENTRY, _load_checkpoint_from_path)
    # This module's binding only: the other readers of run configs are no load of this module's.
    patcher.replace(module, READ, read_run_config)
