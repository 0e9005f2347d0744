"""torch-adam-step's monkeypatch on ``megatron.core.optimizer.distrib_optimizer``: three wrappers of
``DistributedOptimizer`` methods, and the probe. Why: the package's docstring. Imported only when
the target module is.

Each wrapper hands the call to the release's own method and changes only what torch's per-parameter
step needs; with Transformer Engine's or Apex's FusedAdam (no per-parameter step) they change nothing.
"""

from __future__ import annotations

import sys
import types

from ....engine.layers import layer
from ....engine.patching import original
from ....engine.probing import with_globals
from .. import ID, MODULE

CLASS = "DistributedOptimizer"
HYBRID_MODULE = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"


def _torch_adam() -> bool:
    """The release took torch's Adam (no TE / Apex FusedAdam), decided at its import."""
    return not getattr(sys.modules[MODULE], "HAVE_APEX_OR_TE", True)


def _precision_aware(config) -> bool:
    """The release's precision-aware branch (its flag was renamed in 0.14)."""
    return bool(
        getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
        or getattr(config, "use_precision_aware_optimizer", False)
    )


def _hybrid(optimizer) -> bool:
    """``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``): whatever Adam the release imported,
    its CPU optimizers are torch's ``AdamW``, with a ``step`` per parameter in the state it shares."""
    hybrid = getattr(sys.modules.get(HYBRID_MODULE), "HybridDeviceOptimizer", None)
    return hybrid is not None and isinstance(optimizer, hybrid)


def _step_state(self, model_param):
    """The optimizer state of ``model_param``'s shard that keeps torch Adam's per-parameter step:
    torch's Adam's own (not under the precision-aware optimizer, whose state is scaled) or the
    hybrid optimizer's (either branch); None where the step lives in the param groups."""
    hybrid = _hybrid(self.optimizer)
    if not hybrid and (not _torch_adam() or _precision_aware(self.config)):
        return None
    group_index, group_order = self.model_param_group_index_map[model_param]
    shard = self.optimizer.param_groups[group_index]["params"][group_order]
    return self.optimizer.state.get(shard)


@layer(ID, MODULE, "state_dict", owner=CLASS)
def state_dict(below_us, self):
    """``DistributedOptimizer.state_dict``; on torch's Adam before its first step (no parameter has
    state yet) the param groups say step 0, where the release asserts that one step exists."""
    if not _torch_adam() or len(self.optimizer.state) > 0:
        return below_us(self)
    inner = self.optimizer.state_dict()
    out = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
    for group in out["optimizer"]["param_groups"]:
        del group["params"]
        group["step"] = 0.0  # torch's Adam counts from 0 (``state['step'] = tensor(0.0)``)
    if self.grad_scaler:
        out["grad_scaler"] = self.grad_scaler.state_dict()
    return out


@layer(ID, MODULE, "_set_main_param_and_optimizer_states", owner=CLASS)
def set_main_param_and_optimizer_states(below_us, self, model_param, tensors):
    """``DistributedOptimizer._set_main_param_and_optimizer_states`` that leaves the parameter's
    step as it is: ``load_state_dict`` has just set it from the checkpoint's param groups, and the
    loaded per-parameter state has none (fully_reshardable, fully_sharded_model_space) or the one
    the optimizer had before the load (dp_reshardable's non-persistent entry)."""
    state = _step_state(self, model_param)
    step = state.get("step") if state is not None else None
    if step is not None and hasattr(step, "copy_"):
        # The release copies ``tensors[k]`` into every tensor of the state: the step onto itself.
        tensors = {**tensors, "step": step}
    return below_us(self, model_param, tensors)


@layer(ID, MODULE, "load_state_dict", owner=CLASS)
def load_state_dict(below_us, self, state_dict):
    """``DistributedOptimizer.load_state_dict``, then every parameter owns its step tensor (the
    release gives all of them one tensor, which torch's Adam would increment once per parameter),
    and torch's param groups hold no step: it only carried the checkpoint's into each parameter's
    state; torch's Adam keeps none in its groups, and one left there would stay at the loaded value."""
    result = below_us(self, state_dict)
    if _torch_adam():
        own_step_tensors(self.optimizer.state.values())
        for group in self.optimizer.param_groups:
            group.pop("step", None)
    return result


def own_step_tensors(states) -> None:
    seen = set()
    for state in states:
        step = state.get("step") if isinstance(state, dict) else None
        if step is None or not hasattr(step, "clone"):
            continue
        if id(step) in seen:
            state["step"] = step.clone()
        else:
            seen.add(id(step))


# -- probe: the release's own methods on inert stand-ins --------------------------------------------


def release_method_on_torch_adam(cls, name):
    """The release's method, run on torch's Adam path (``HAVE_APEX_OR_TE`` False in its globals
    only: the live module keeps the flag its import set)."""
    return with_globals(original(cls, name), HAVE_APEX_OR_TE=False)


def optimizer_stand_in(torch, step=None):
    """What the two methods read of a DistributedOptimizer: one model parameter, its main-parameter
    shard in a torch Adam (with state when ``step`` is given), no grad scaler."""
    model_param, main_param = torch.zeros(2), torch.nn.Parameter(torch.zeros(2))
    adam = torch.optim.Adam([main_param])
    if step is not None:
        adam.state[main_param] = {
            "step": torch.tensor(step),
            "exp_avg": torch.zeros(2),
            "exp_avg_sq": torch.zeros(2),
        }
    config = types.SimpleNamespace(
        use_precision_aware_optimizer=False, use_precision_aware_optimizer_no_fp8_or_ds_fp8=False
    )
    opt = types.SimpleNamespace(
        optimizer=adam,
        grad_scaler=None,
        config=config,
        ddp_config=types.SimpleNamespace(use_custom_fsdp=False, use_megatron_fsdp=False),
        model_param_group_index_map={model_param: (0, 0)},
    )
    return opt, model_param, main_param


def _hybrid_defect(module, torch, set_states):
    """(d) on a HybridDeviceOptimizer stand-in (uninitialised: no CUDA stream is made) under the
    precision-aware branch Megatron-LM requires with CPU offload; None where the release has none."""
    hybrid_cls = module.__dict__.get("HybridDeviceOptimizer")
    if hybrid_cls is None:
        return None
    opt, model_param, _ = optimizer_stand_in(torch)
    shard = torch.zeros(2)
    hybrid = hybrid_cls.__new__(hybrid_cls)
    hybrid.param_groups = [{"params": [shard]}]
    hybrid.state = {shard: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}}
    opt.optimizer = hybrid
    opt.config.use_precision_aware_optimizer = opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    loaded = {"param": torch.ones(2), "exp_avg": torch.ones(2), "exp_avg_sq": torch.ones(2)}
    set_states(opt, model_param, {**loaded, "step": torch.tensor(1.0)})
    if float(hybrid.state[shard]["step"]) != 3.0:
        return "(d) with CPU offload (HybridDeviceOptimizer, torch's AdamW on the CPU) likewise"
    return None


def defects(module) -> list:
    """Which of (a), (b), (c) the release's own code shows on torch's Adam (its methods run with the
    torch path's flag: the code is there whichever Adam this installation imports)."""
    import torch

    cls = module.__dict__[CLASS]
    found = []
    opt, _, _ = optimizer_stand_in(torch)
    try:
        release_method_on_torch_adam(cls, "state_dict")(opt)
    except AssertionError:
        found.append("(a) state_dict of a fresh optimizer asserts that one step exists")
    set_states = torch.no_grad()(release_method_on_torch_adam(cls, "_set_main_param_and_optimizer_states"))
    loaded = {"param": torch.ones(2), "exp_avg": torch.ones(2), "exp_avg_sq": torch.ones(2)}
    opt, model_param, main_param = optimizer_stand_in(torch, step=3.0)
    set_states(opt, model_param, {**loaded, "step": torch.tensor(1.0)})
    if float(opt.optimizer.state[main_param]["step"]) != 3.0:
        found.append("(b) a per-parameter step in the loaded state overwrites the param groups' step")
    opt, model_param, main_param = optimizer_stand_in(torch, step=3.0)
    try:
        set_states(opt, model_param, loaded)
    except KeyError:
        found.append("(c) a loaded state without per-parameter step raises KeyError: 'step'")
    hybrid = _hybrid_defect(module, torch, set_states)
    if hybrid:
        found.append(hybrid)
    return found


def probe(module: types.ModuleType):
    if CLASS not in module.__dict__:
        return None, f"{MODULE} has no {CLASS}"
    found = defects(module)
    if not found:
        return False, "DistributedOptimizer hands torch Adam's step over from the param groups on every load path"
    where = (
        "this installation uses torch's Adam"
        if not module.__dict__.get("HAVE_APEX_OR_TE", True)
        else "(a)-(c) reached only on torch's Adam (this installation imports a FusedAdam), (d) with CPU offload"
    )
    return True, f"DistributedOptimizer on torch's Adam: {'; '.join(found)} ({where})"
