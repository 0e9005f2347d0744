"""model-load-fallback as Megatron-Core would carry it: in ``megatron/training/checkpointing.py`` the
non-strict retry of ``load_checkpoint``'s nested ``load_model_state_dict`` goes through
``_load_model_non_strict`` (below), which loads as before and hands what torch reports to
``_dropped_model_weights`` (its text, and the constants beside it, from runtime/core.py's replacement
section: the code the monkeypatch runs). The wrappers between ``load_checkpoint`` and the model drop
what torch's ``load_state_dict`` returns, so the helper hears it from a post-load hook on the
unwrapped model for that one call (the monkeypatch, which cannot edit the nested helper, hears it
from its layer on ``MegatronModule.load_state_dict`` instead). Both go in above ``load_checkpoint``.

The one edited line is the retry's call; the helpers go where the other diffs of this file do not
edit (strictness-return-keys inserts its own before ``load_checkpoint`` too: the two insertions
apply in either order). tests/patches runs the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace, insert_before, replacement_section

CHECKPOINTING = "megatron/training/checkpointing.py"

_RETRY = "load_return = module.load_state_dict(state_dict, strict=False)\n"
_RETRY_JUDGED = "load_return = _load_model_non_strict(module, state_dict)\n"

_LOADER = '''def _load_model_non_strict(module, state_dict):
    """``module.load_state_dict(state_dict, strict=False)``, the weights it leaves out judged by
    _dropped_model_weights. The wrappers around the model (DDP, Float16Module, Megatron-FSDP) drop
    what torch's load returns: a hook on the model itself hears it."""
    heard = []
    hook = unwrap_model(module).register_load_state_dict_post_hook(lambda _, keys: heard.append(keys))
    try:
        load_return = module.load_state_dict(state_dict, strict=False)
    finally:
        hook.remove()
    for keys in heard[-1:]:
        _dropped_model_weights(keys.missing_keys, keys.unexpected_keys)
    return load_return


'''


def _helpers() -> str:
    from ..runtime import core

    return replacement_section(core).strip("\n") + "\n\n\n" + _LOADER


def source_edits(release: str) -> list:
    return [
        Replace(CHECKPOINTING, _RETRY, _RETRY_JUDGED),
        insert_before(CHECKPOINTING, "def load_checkpoint(", _helpers()),
    ]
