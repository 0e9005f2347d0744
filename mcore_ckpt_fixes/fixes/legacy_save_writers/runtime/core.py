"""legacy-save-writers' monkeypatch: the probe (the release's own writer condition on inert
stand-ins) and ``save_checkpoint`` wrapped so that one rank per legacy file name writes it: the
save elects this rank or not in a context variable, and the module's ``mpu`` (replaced at apply by
:class:`ElectedWriterView`) answers the release's writer condition from it; nothing is swapped in the
module for the length of a save. Imported
only when ``megatron.training.checkpointing`` is; the declaration and why are in the package's
docstring (:mod:`mcore_ckpt_fixes.fixes.legacy_save_writers`).
"""

from __future__ import annotations

import ast
import contextvars
import inspect
import sys
import textwrap
import types

import torch

from ....engine.layers import layer
from ....engine.patching import MARK, Patcher, is_replacement, original
from .. import ID, MODULE

NAME = "save_checkpoint"

# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/training/checkpointing.py, above save_checkpoint.


def _writes_legacy_checkpoint(checkpoint_name):
    """Whether this rank writes ``checkpoint_name`` in a legacy (torch format) save: the lowest
    global rank of those whose checkpoint file has that name. The name holds the TP, PP and EP
    ranks only, so expert-DP rank 0 alone misses files where TP > EP x ETP; one writer per name
    writes every file, and never two ranks the same one."""
    names = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(names, checkpoint_name)
    return names.index(checkpoint_name) == torch.distributed.get_rank()


# -- end of replacement ---


# This context's answer for the legacy save it runs (0: this rank writes its file, 1: it does not), or None.
ELECTED_WRITER_ANSWER = contextvars.ContextVar("mcore_ckpt_fixes_legacy_writer", default=None)


class ElectedWriterView:
    """``parallel_state`` as ``megatron.training.checkpointing`` reads it (its ``mpu``): inside a
    legacy save, ``get_expert_data_parallel_rank()`` answers 0 on the rank elected to write its file
    and 1 on the others (the release writes where it is 0); every other name, and every call outside
    such a save (another thread, another task), is ``parallel_state``'s own."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __repr__(self):
        return f"<{type(self).__name__} of {self.real!r}>"

    def get_expert_data_parallel_rank(self, *args, **kwargs):
        answer = ELECTED_WRITER_ANSWER.get()
        return self.real.get_expert_data_parallel_rank(*args, **kwargs) if answer is None else answer


setattr(ElectedWriterView, MARK, ID)


def _legacy_checkpoint_name(module, fn, args, kwargs):
    """The file this rank's legacy save writes, as the release names it; None for any other save
    (a distributed format, a non-persistent checkpoint, no process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    margs = module.get_args()
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if margs.use_dist_ckpt or a.get("non_persistent_ckpt"):
        return None
    return module.get_checkpoint_name(
        margs.save,
        a["iteration"],
        release=a.get("release", False),
        pipeline_parallel=a.get("pipeline_parallel"),
        tensor_rank=a.get("tensor_rank"),
        pipeline_rank=a.get("pipeline_rank"),
        expert_parallel=a.get("expert_parallel"),
        expert_rank=a.get("expert_rank"),
        return_base_dir=False,
    )


@layer(ID, MODULE, NAME)
def save_checkpoint(below_us, *args, **kwargs):
    """``save_checkpoint`` where a legacy save writes each file name from exactly one rank."""
    module = sys.modules[MODULE]
    name = _legacy_checkpoint_name(module, below_us, args, kwargs)
    if name is None:
        return below_us(*args, **kwargs)
    token = ELECTED_WRITER_ANSWER.set(0 if _writes_legacy_checkpoint(name) else 1)
    try:
        return below_us(*args, **kwargs)
    finally:
        ELECTED_WRITER_ANSWER.reset(token)


# -- probe: the release's own writer condition on inert stand-ins ----------------------------------


def _writer_if(func: ast.FunctionDef):
    """The top-level ``if`` of ``save_checkpoint`` whose body builds the state dict (the writers'
    branch), and the statements before it."""
    for i, stmt in enumerate(func.body):
        if isinstance(stmt, ast.If) and any(
            isinstance(n, ast.Call) and getattr(n.func, "id", None) == "generate_state_dict"
            for s in stmt.body
            for n in ast.walk(s)
        ):
            return stmt, func.body[:i]
    return None, []


def _names(node, ctx) -> set:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}


def writes_on_expert_dp_rank_1(module) -> bool | None:
    """Does the release's own condition let a legacy save write on a rank with dense-DP rank 0 and
    expert-DP rank 1 (TP rank 1 of TP=2, EP=1, expert TP=1)? None: no such condition.

    The condition is evaluated alone, on stand-ins for ``torch.distributed`` and ``mpu``; the locals
    it reads are computed by the release's own statements before it, on the same stand-ins. A
    release carrying this fix's source diff elects a writer per file (stood in: this rank's file
    has no other writer)."""
    fn = module.__dict__.get(NAME)
    if fn is None:
        return None
    if is_replacement(fn):
        fn = original(module, NAME)
    func = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    cond, before = _writer_if(func)
    if cond is None:
        return None
    dist = types.SimpleNamespace(is_initialized=lambda: True, get_rank=lambda: 1)
    mpu = types.SimpleNamespace(
        get_data_parallel_rank=lambda *a, **k: 0, get_expert_data_parallel_rank=lambda *a, **k: 1
    )
    ns = dict(module.__dict__)
    ns.update(torch=types.SimpleNamespace(distributed=dist), mpu=mpu, ckpt_type=module.CheckpointType.LEGACY)
    ns.update({p: None for p in inspect.signature(fn).parameters}, checkpoint_name="mp_rank_01")
    ns["_writes_legacy_checkpoint"] = lambda name: True
    needed = _names(cond.test, ast.Load) - ns.keys()
    for stmt in before:
        # Statements that set a local the condition reads, from names the stand-ins give (not,
        # e.g., another feature's branch that reads ``args``).
        stored = _names(stmt, ast.Store)
        if needed & stored and _names(stmt, ast.Load) <= ns.keys() | stored:
            exec(compile(ast.Module([stmt], []), "<save_checkpoint>", "exec"), ns)
    return bool(eval(compile(ast.Expression(cond.test), "<save_checkpoint>", "eval"), ns))


def probe(module: types.ModuleType):
    writes = writes_on_expert_dp_rank_1(module)
    if writes is None:
        return None, f"{MODULE}.{NAME} has no writer branch for legacy saves"
    if writes:
        return False, "a legacy save writes on every rank that owns a checkpoint file"
    return True, (
        "a legacy save writes only on expert-DP rank 0: with TP > EP x ETP some mp_rank_* files are never written"
    )


# One view per parallel_state module: applied again after a revert, the fix puts the same object back.
_VIEWS: dict = {}


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    held = module.__dict__["mpu"]
    if not isinstance(held, ElectedWriterView):
        held = _VIEWS.setdefault(id(held), ElectedWriterView(held))
    patcher.replace(module, "mpu", held)
    patcher.replace_function(module, NAME, save_checkpoint)
