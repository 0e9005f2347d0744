"""Standalone ``megatron-fsdp`` (PyPI) installed beside Megatron-Core.

``megatron-fsdp`` 0.6.1 ships ``megatron_fsdp`` — the same code Megatron-Core 0.19.2 vendors as
``megatron.core.distributed.fsdp.src.megatron_fsdp`` (file for file identical). The question is
whether any fix's target has a twin there that Megatron-Core, Megatron-LM's training loop or a
framework reaches. Measured here, with it installed and imported first:

* no Megatron-Core module imports the top-level ``megatron_fsdp``: Megatron-Core, ``megatron.training``
  (and Megatron-Bridge 0.6.2, which imports the vendored path by name) use their own copy;
* no fix patches a function of Megatron-FSDP itself: expert-keys replaces the *callers'* bindings of
  ``preprocess_state_dict_for_uneven_dtensor`` (``megatron.training``'s, Bridge's), gdn-fsdp-split and
  expert-keys live in ``megatron.core.transformer.fsdp_dtensor_checkpoint``, dtensor-placement in
  ``megatron.core.utils``, hsdp-ep-guard in the Megatron-Core adapter, none of which exist in
  ``megatron_fsdp``; and no loaded module binds a ``megatron_fsdp`` function under a name a fix
  replaces.

So nothing is to patch there today: this test fails the day a Megatron-Core module starts importing
the standalone package or a fix starts replacing a name the standalone package also defines, so the
twin is patched then (gated by megatron-fsdp's version).
"""

from __future__ import annotations

import sys

from framework_import import import_framework


def test_megatron_core_and_training_use_their_own_copy():
    standalone = import_framework("megatron-fsdp", "megatron_fsdp.uneven_dtensor")
    import mcore_ckpt_fixes
    from mcore_ckpt_fixes.engine.registry import ENGINE

    import megatron.core.distributed.fsdp.mcore_fsdp_adapter  # noqa: F401
    import megatron.core.transformer.fsdp_dtensor_checkpoint  # noqa: F401
    import megatron.training.checkpointing as training

    vendored = sys.modules["megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor"]
    assert vendored is not standalone
    # The binding megatron.training's fsdp_dtensor save and load call is the vendored function (as
    # the fix wrapped it), never the standalone package's.
    called = training.preprocess_state_dict_for_uneven_dtensor
    assert getattr(called, "__module__", "").startswith("mcore_ckpt_fixes.") or called.__module__ == vendored.__name__

    # Which modules of Megatron-Core import the standalone package: none.
    users = sorted(
        name
        for name, mod in list(sys.modules.items())
        if name.startswith("megatron.")
        and mod is not None
        and any(
            getattr(v, "__module__", None) and str(getattr(v, "__module__", "")).startswith("megatron_fsdp")
            for v in list(vars(mod).values())
        )
    )
    assert users == [], f"Megatron-Core modules bind the standalone megatron_fsdp: {users}"

    # Twins: a function of the vendored Megatron-FSDP whose binding a fix replaces (expert-keys:
    # megatron.training's preprocess_state_dict_for_uneven_dtensor). The standalone package's
    # function of the same name is its twin; a module that bound the twin would miss the fix.
    mcore_ckpt_fixes.apply()
    vendored_prefix = "megatron.core.distributed.fsdp.src.megatron_fsdp"
    twins = []
    for fix_id in ENGINE.fixes:
        for record in ENGINE.changes(fix_id):
            origin = getattr(record.before, "__module__", None) or ""
            if origin.startswith(vendored_prefix):
                twin_module = sys.modules.get("megatron_fsdp" + origin[len(vendored_prefix) :])
                twins.append((fix_id, record.name, getattr(twin_module, record.before.__name__)))
    assert ("expert-keys", "preprocess_state_dict_for_uneven_dtensor") in [(f, n) for f, n, _ in twins], twins
    for fix_id, name, twin in twins:
        binders = sorted(
            mod_name
            for mod_name, mod in list(sys.modules.items())
            if mod is not None
            and not mod_name.startswith("megatron_fsdp")
            and any(v is twin for v in list(vars(mod).values()))
        )
        assert binders == [], (
            f"{fix_id}: {binders} bind the standalone megatron_fsdp twin of {name}, which the fix does not cover"
        )
