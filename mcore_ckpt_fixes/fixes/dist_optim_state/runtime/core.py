"""dist-optim-state's monkeypatch on ``megatron.core.optimizer.distrib_optimizer``: wrappers of three
``DistributedOptimizer`` methods, the probe and apply. Why: the package's docstring. Imported only
when the target module is.

Every wrapper hands the call to the release's own method; what it changes is only what the defect
the probe found needs, and a call shape it does not recognise goes to the release untouched.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import types

from ....engine.layers import layer
from ....engine.patching import Patcher, is_replacement, original
from .. import ID, MODULE

CLASS = "DistributedOptimizer"
# What Megatron-LM's own save_checkpoint asks for unless told --dist-ckpt-optim-fully-reshardable.
DEFAULT_FORMAT = "dp_reshardable"
FORMAT_KEY = "distrib_optim_sharding_type"

log = logging.getLogger("mcore_ckpt_fixes")


# -- (a) and (b): sharded_state_dict ------------------------------------------------------------------


def bound_call(fn, args, kwargs):
    """The release's arguments by name, defaults filled in; None for a call it would reject."""
    try:
        call = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return None
    call.apply_defaults()
    return call


def names_no_format(call) -> bool:
    """(b): neither ``sharding_type`` nor ``metadata['distrib_optim_sharding_type']`` is given."""
    args = call.arguments
    if "metadata" not in args or args.get("sharding_type") is not None:
        return False
    metadata = args["metadata"]
    return metadata is None or (isinstance(metadata, dict) and FORMAT_KEY not in metadata)


def _plain_state(self) -> bool:
    """This optimizer's state is plain tensors in ``self.optimizer.state`` that ``init_state_fn``
    creates (not Megatron-FSDP's, the precision-aware optimizer's or the hybrid optimizer's)."""
    module = sys.modules[MODULE]
    config, ddp_config = getattr(self, "config", None), getattr(self, "ddp_config", None)
    hybrid = getattr(module, "HybridDeviceOptimizer", None)
    return not (
        getattr(self, "init_state_fn", None) is None
        or getattr(ddp_config, "use_megatron_fsdp", False)
        or getattr(ddp_config, "use_custom_fsdp", False)
        or getattr(config, "use_precision_aware_optimizer", False)
        or (hybrid is not None and isinstance(self.optimizer, hybrid))
    )


def _fresh(self) -> bool:
    """(a): this optimizer has taken no step and loaded nothing (no parameter has state), and its
    state is plain tensors (:func:`_plain_state`)."""
    if not _plain_state(self):
        return False
    params = [p for group in self.optimizer.param_groups for p in group["params"]]
    return bool(params) and not any(self.optimizer.state.get(p) for p in params)


@contextlib.contextmanager
def _zero_moments(self):
    """The optimizer holds the state Adam starts from (zero moments; on torch's Adam also step 0,
    which its ``state_dict`` reads) while the release describes it, and no state afterwards: a save
    writes zero moments, a load fills the described tensors and ``load_state_dict`` allocates the
    optimizer's own state (it does so only where the optimizer has none)."""
    import torch

    state = self.optimizer.state
    self.init_state_fn(self.optimizer, self.config)
    if not getattr(sys.modules[MODULE], "HAVE_APEX_OR_TE", True):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state[p].setdefault("step", torch.tensor(0.0))
    try:
        yield
    finally:
        state.clear()


@layer(ID, MODULE, "sharded_state_dict", owner=CLASS)
def sharded_state_dict(release, self, *args, **kwargs):
    """``DistributedOptimizer.sharded_state_dict``: a call that names no format gets
    ``dp_reshardable`` where the release's default cannot be saved, and a request built with
    ``is_loading=False`` on an optimizer without state describes zero moments."""
    call = bound_call(release, (self,) + args, kwargs)
    if call is None:
        return release(self, *args, **kwargs)
    if _DEFECTS.get("default_format") and names_no_format(call):
        call.arguments["metadata"] = {**(call.arguments["metadata"] or {}), FORMAT_KEY: DEFAULT_FORMAT}
        log.debug("%s: DistributedOptimizer.sharded_state_dict without a format: %s", ID, DEFAULT_FORMAT)
    if _DEFECTS.get("fresh_request") and not call.arguments.get("is_loading") and _fresh(self):
        with _zero_moments(self):
            return release(*call.args, **call.kwargs)
    return release(*call.args, **call.kwargs)


# -- (a), the load side: a checkpoint saved before Adam's first step ---------------------------------

ADAM_STATE = frozenset(("exp_avg", "exp_avg_sq", "step"))


def _adam(optimizer) -> bool:
    """Torch's Adam or AdamW, or the Adam the release imported (TE's or Apex's FusedAdam): the
    optimizers whose step count says whether they have stepped."""
    import torch

    kinds = (torch.optim.Adam, torch.optim.AdamW, getattr(sys.modules[MODULE], "Adam", None))
    return isinstance(optimizer, tuple(k for k in kinds if isinstance(k, type)))


def loaded_before_first_step(self) -> bool:
    """The optimizer holds what a checkpoint of an Adam that had not stepped restores: no step
    counted (FusedAdam counts in its param groups, torch's Adam per parameter) and every moment zero,
    the state (a) describes for an optimizer without state."""
    if not _plain_state(self) or not _adam(self.optimizer):
        return False
    if any(group.get("step") for group in self.optimizer.param_groups):
        return False
    states = [s for s in self.optimizer.state.values() if s]
    for s in states:
        if not ADAM_STATE.issuperset(s) or (s.get("step") is not None and float(s["step"]) != 0.0):
            return False
        if any(s[k].any() for k in ("exp_avg", "exp_avg_sq") if k in s):
            return False
    return bool(states)


@layer(ID, MODULE, "load_state_dict", owner=CLASS)
def load_state_dict(release, self, state_dict):
    """``DistributedOptimizer.load_state_dict``; where the checkpoint's parameter state is that of an
    Adam that had not stepped (saved before its first step, fp16 runs whose first steps overflow
    among them), the optimizer is left without state, as the run that saved it was: Adam creates the
    same zero moments at its first step, and a resumed run then holds what the uninterrupted one
    holds, step for step. The release's own call from ``sharded_state_dict(is_loading=True)``
    carries no parameter state and is left as it is."""
    result = release(self, state_dict)
    if isinstance(state_dict, dict) and "param_state" in state_dict and loaded_before_first_step(self):
        self.optimizer.state.clear()
        log.debug("%s: a checkpoint saved before the optimizer's first step: no optimizer state kept", ID)
    return result


# -- (c): load_parameter_state_from_dp_reshardable ----------------------------------------------------


@layer(ID, MODULE, "load_parameter_state_from_dp_reshardable", owner=CLASS)
def load_parameter_state_from_dp_reshardable(release, self, state_dict):
    """The release's method under ``torch.no_grad()``, as every other ``load_parameter_state_from_*``
    is: it copies into the main parameters, which in an fp32 model are views of parameters that
    require grad."""
    import torch

    with torch.no_grad():
        return release(self, state_dict)


# -- probe: the release's own methods on inert stand-ins --------------------------------------------

# defect name -> True where the probe found it (set by apply; read by the wrappers).
_DEFECTS: dict = {}


def _release_method(cls, name):
    fn = cls.__dict__[name]
    return original(cls, name) if is_replacement(fn) else fn


class _Describer:
    """What ``sharded_state_dict`` reads of a DistributedOptimizer that has not stepped yet,
    recording whether the optimizer had state (the release's ``load_state_dict``, or anything that
    fills ``optimizer.state``) when the parameter state was described, and which format. Any other
    method the release's code calls is the class's own, run on this stand-in."""

    checkpoint_fully_reshardable_formats = ("fully_sharded_model_space", "fully_reshardable", "fsdp_dtensor")
    data_parallel_group_idx = 0
    distributed_optimizer_instance_id = 0

    def __init__(self, cls):
        import collections

        import torch

        param = torch.zeros(1)
        self._cls = cls
        self.ddp_config = types.SimpleNamespace(use_custom_fsdp=False, use_megatron_fsdp=False)
        self.config = types.SimpleNamespace(use_precision_aware_optimizer=False)
        self.data_parallel_group = types.SimpleNamespace(rank=lambda: 0)
        self.optimizer = types.SimpleNamespace(param_groups=[{"params": [param]}], state=collections.defaultdict(dict))
        self.init_state_fn = lambda opt, config=None: opt.state[param].update(exp_avg=torch.zeros(1))
        self.allocated = False
        self.described = None  # (format method, whether the optimizer had state then)

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        self.allocated = True

    def __getattr__(self, name):
        if name.startswith("sharded_param_state_"):

            def describe(*args, **kwargs):
                had_state = self.allocated or any(self.optimizer.state.values())
                self.described = (name[len("sharded_param_state_") :], had_state)
                return {}

            return describe
        fn = getattr(self.__dict__.get("_cls"), name, None)
        if not callable(fn):
            raise AttributeError(name)
        return types.MethodType(fn, self)


def _describe(cls, fn, **kwargs):
    standin = _Describer(cls)
    fn(standin, {}, **kwargs)
    return standin.described


def _request_defects(cls) -> dict:
    fn = _release_method(cls, "sharded_state_dict")
    params = inspect.signature(fn).parameters
    fmt = {"metadata": {FORMAT_KEY: "fully_sharded_model_space"}} if "metadata" in params else {}
    found = {}
    # (a) the state is allocated for a load request, and not for one built without is_loading.
    loading, not_loading = _describe(cls, fn, is_loading=True, **fmt), _describe(cls, fn, is_loading=False, **fmt)
    if loading and loading[1] and not_loading and not not_loading[1]:
        found["fresh_request"] = "a request built without is_loading on a fresh optimizer describes no moments"
    # (b) the default format is fully_sharded_model_space, which this release cannot describe.
    if "metadata" in params and (_describe(cls, fn, is_loading=False) or ("",))[0] == "fs_model_space":
        if _rejects_flattened_range():
            found["default_format"] = (
                "sharded_state_dict without metadata defaults to fully_sharded_model_space, which "
                "ShardedTensor.validate_metadata_integrity rejects (flattened_range)"
            )
    return found


def _rejects_flattened_range() -> bool:
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    try:  # some releases validate on construction already
        ShardedTensor(
            "probe", torch.zeros(2), torch.float32, (2,), (2,), (0,), None, flattened_range=slice(0, 2)
        ).validate_metadata_integrity()
    except Exception as e:  # CheckpointingException
        return "flattened_range" in str(e)
    return False


def _load_defect(cls) -> dict:
    """(c): the release's dp_reshardable load copies into the main parameters with grad enabled."""
    import torch

    if "load_parameter_state_from_dp_reshardable" not in cls.__dict__:
        return {}
    seen = []
    model_param = torch.zeros(1)
    standin = types.SimpleNamespace(
        per_bucket_numel_unpadded=None,
        gbuf_ranges=[{torch.float32: [{"param_map": {model_param: None}}]}],
        _set_main_param_and_optimizer_states=lambda p, tensors: seen.append(torch.is_grad_enabled()),
    )
    state = {0: {torch.float32: [[{"padding": False}]]}}
    with torch.enable_grad():
        _release_method(cls, "load_parameter_state_from_dp_reshardable")(standin, state)
    if seen and all(seen):
        return {"no_grad_load": "dp_reshardable's load copies into the main parameters with grad enabled"}
    return {}


def defects(module) -> dict:
    """Which of (a), (b), (c) the release's own code shows: ``{name: what}``."""
    cls = module.__dict__[CLASS]
    return {**_request_defects(cls), **_load_defect(cls)}


# What the probe found in each module it judged (by id), for apply: the probe runs once per decision.
_PROBED: dict = {}


def probe(module: types.ModuleType):
    if CLASS not in module.__dict__:
        return None, f"{MODULE} has no {CLASS}"
    found = defects(module)
    _PROBED[id(module)] = found  # apply reads the verdict instead of probing again
    if not found:
        return False, "DistributedOptimizer describes and loads its whole state from every call shape"
    return True, f"DistributedOptimizer: {'; '.join(found.values())}"


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    cls = module.__dict__[CLASS]
    found = _PROBED.pop(id(module), None)
    if found is None:  # applied without the engine's probe first
        found = defects(module)
    _DEFECTS.clear()
    _DEFECTS.update({name: True for name in found})
    if "fresh_request" in found or "default_format" in found:
        patcher.replace(cls, "sharded_state_dict", sharded_state_dict)
    if "fresh_request" in found:
        patcher.replace(cls, "load_state_dict", load_state_dict)
    if "no_grad_load" in found:
        patcher.replace(cls, "load_parameter_state_from_dp_reshardable", load_parameter_state_from_dp_reshardable)
