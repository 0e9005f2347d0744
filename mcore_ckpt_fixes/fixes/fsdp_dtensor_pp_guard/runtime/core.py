"""fsdp-dtensor-pp-guard's monkeypatch on ``megatron.training.checkpointing``: a layer on
``_load_base_checkpoint`` that refuses a ``fsdp_dtensor`` checkpoint whose pipeline layout is not
the run's, and the probe. Why: the package's docstring. Imported only when the target module is.
"""

from __future__ import annotations

import inspect
import sys
import types

from ....engine.layers import layer
from ....engine.patching import original
from ....engine.probing import in_scope, module_scope
from .. import ID, MODULE

NAME = "_load_base_checkpoint"

# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/training/checkpointing.py, above _load_base_checkpoint.

# What decides which global layers a pipeline stage holds: an fsdp_dtensor checkpoint names each
# layer by its index within its stage, so these must be the ones it was saved with.
_FSDP_DTENSOR_LAYOUT_ARGS = (
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def _refuse_fsdp_dtensor_pipeline_change(state_dict, args, checkpoint_name):
    """Raise if the fsdp_dtensor checkpoint's arguments in ``state_dict`` lay the layers out over
    the pipeline otherwise than ``args``: each stage would load another stage's layers."""
    saved = state_dict.get("args") if isinstance(state_dict, dict) else None
    if saved is None or getattr(args, "use_checkpoint_args", False):
        return
    changed = [
        (name, getattr(saved, name), getattr(args, name))
        for name in _FSDP_DTENSOR_LAYOUT_ARGS
        if hasattr(saved, name) and hasattr(args, name) and getattr(saved, name) != getattr(args, name)
    ]
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


@layer(ID, MODULE, NAME)
def _load_base_checkpoint(below_us, *args, **kwargs):
    """``_load_base_checkpoint``, refusing a fsdp_dtensor checkpoint of another pipeline layout as
    soon as its arguments are read (from 0.19 before any tensor: the rank-0 read of the arguments)."""
    module = sys.modules[MODULE]
    out = below_us(*args, **kwargs)
    if isinstance(out, tuple) and len(out) == 4 and out[3] == getattr(module.CheckpointType, "FSDP_DTENSOR", None):
        call = inspect.signature(original(module, NAME)).bind(*args, **kwargs)
        _refuse_fsdp_dtensor_pipeline_change(out[0], call.arguments["args"], out[1])
    return out


# -- probe: the release's own fsdp_dtensor preprocessing of a later stage's layer --------------------


def keeps_stage_local_layer_names(module) -> bool:
    """Does the release's ``preprocess_fsdp_dtensor_state_dict`` (what every fsdp_dtensor save's
    and load's state dict goes through) hand a later pipeline stage's first layer on under its
    stage-local name? Run in a copy of the module's globals with pipeline stage 1 of 2 stood in and
    Megatron-FSDP's uneven-DTensor metadata step (a collective) and the fp8 step made no-ops."""
    stand_in_mpu = types.SimpleNamespace(
        get_pipeline_model_parallel_rank=lambda *a, **k: 1,
        get_pipeline_model_parallel_world_size=lambda *a, **k: 2,
        is_pipeline_first_stage=lambda *a, **k: False,
        is_pipeline_last_stage=lambda *a, **k: True,
    )
    names = {"mpu": stand_in_mpu, "parallel_state": stand_in_mpu}
    names.update(
        {n: (lambda *a, **k: None) for n in ("preprocess_state_dict_for_uneven_dtensor", "handle_fp8_extra_state_case")}
    )
    preprocess = in_scope(original(module, "preprocess_fsdp_dtensor_state_dict"), module_scope(module, **names))
    key = "decoder.layers.0.mlp.linear_fc2.weight"
    args = types.SimpleNamespace(swiglu=False, num_experts=None, pipeline_model_parallel_size=2, num_layers=2)
    out = preprocess(args, {"model": {key: None}}, None)
    return key in out["model"]


def _names_read(code) -> set:
    """The global and attribute names ``code`` reads, its nested functions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_read(const)
    return names


def loads_fsdp_dtensor(fn) -> bool:
    """Is ``fn`` the release's loader that :func:`_load_base_checkpoint` wraps: it takes the run's
    ``args`` (the layer reads them from the call) and loads an fsdp_dtensor checkpoint through
    ``preprocess_fsdp_dtensor_state_dict``, telling it apart by ``CheckpointType.FSDP_DTENSOR`` (what
    the layer reads from its result)?"""
    code = getattr(fn, "__code__", None)
    try:
        takes_args = "args" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    needed = {"FSDP_DTENSOR", "preprocess_fsdp_dtensor_state_dict"}
    return takes_args and code is not None and needed <= _names_read(code)


def probe(module: types.ModuleType):
    checkpoint_type = module.__dict__.get("CheckpointType")
    if (
        NAME not in module.__dict__
        or checkpoint_type is None
        or not hasattr(checkpoint_type, "FSDP_DTENSOR")
        or "preprocess_fsdp_dtensor_state_dict" not in module.__dict__
    ):
        return None, f"{MODULE} has no fsdp_dtensor load"
    if not loads_fsdp_dtensor(original(module, NAME)):
        return None, f"{NAME} takes no args or loads no fsdp_dtensor checkpoint: not the loader this guard wraps"
    if not keeps_stage_local_layer_names(module):
        return False, "fsdp_dtensor state dicts name a later stage's layers by their global number"
    if callable(module.__dict__.get("_refuse_fsdp_dtensor_pipeline_change")):
        # A source carrying this guard's diff (patches/fsdp-dtensor-pp-guard/).
        return False, "the fsdp_dtensor load refuses a checkpoint of another pipeline layout"
    return True, "fsdp_dtensor checkpoints name each layer by its index within its pipeline stage"
