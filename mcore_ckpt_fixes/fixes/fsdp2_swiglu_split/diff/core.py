"""fsdp2-swiglu-split as Megatron-Core would carry it: ``megatron/core/transformer/mlp.py`` gets
``_swiglu_factory_for_dtensor_shard`` and its helpers above ``class MLP`` (their text taken from
runtime/core.py's replacement section, the code the monkeypatch runs), and
``MLP.sharded_state_dict`` hands each factory ``apply_swiglu_sharded_factory`` builds to it, with
the parameter it describes. tests/patches runs the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import PatchgenError, Transform, insert_before, replacement_section

MLP_FILE = "megatron/core/transformer/mlp.py"
_CLASS = "class MLP(MegatronModule):\n"
_CALL = "sub_sd[k] = apply_swiglu_sharded_factory("


def _helpers() -> str:
    from ..runtime import core

    return replacement_section(core).strip("\n") + "\n\n\n"


def wrap_factory_call(text: str) -> str:
    """``sub_sd[k] = apply_swiglu_sharded_factory(...)`` (its arguments as the release has them,
    one line or several) -> the same call handed to ``_swiglu_factory_for_dtensor_shard`` with
    the parameter ``k`` names in ``module`` (linear_fc1)."""
    if text.count(_CALL) != 1:
        raise PatchgenError(f"{MLP_FILE}: anchor found {text.count(_CALL)} times (need 1): {_CALL!r}")
    at = text.index(_CALL)
    line_start = text.rfind("\n", 0, at) + 1
    indent = text[line_start:at]
    depth, end = 0, at + len(_CALL) - 1
    for end in range(at + len(_CALL) - 1, len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            break
    args = " ".join(text[at + len(_CALL) : end].split())
    new = (
        f"sub_sd[k] = _swiglu_factory_for_dtensor_shard(\n"
        f"{indent}    apply_swiglu_sharded_factory({args}),\n"
        f"{indent}    getattr(module, k.rsplit('.', 1)[1], None),\n"
        f"{indent})"
    )
    return text[:at] + new + text[end + 1 :]


def source_edits(release: str) -> list:
    return [insert_before(MLP_FILE, _CLASS, _helpers()), Transform(MLP_FILE, wrap_factory_call)]
