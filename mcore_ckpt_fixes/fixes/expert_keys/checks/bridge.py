"""expert-keys' round trip driven through Megatron-Bridge's own fsdp_dtensor preprocessing (the
Bridge target, :mod:`..runtime.bridge`). Not registered as a scenario: it needs Megatron-Bridge
installed (tests/frameworks/test_bridge_expert_keys.py runs it in the Bridge line)."""

from __future__ import annotations

from .core import round_trip


def bridge_ep2_grouped(rank, world_size, ckpt_dir, patched, device="cpu", variant="grouped"):
    """EP=2 on 2 ranks through Megatron-Bridge's ``preprocess_fsdp_dtensor_state_dict`` (its save and
    load both run it): single grouped weight + bias (``variant="grouped"``) or a grouped bias beside
    indexed weights (``"grouped_bias"``)."""
    assert world_size == 2, f"bridge_ep2_grouped needs 2 ranks, got {world_size}"
    return round_trip(rank, world_size, ckpt_dir, patched, device, variant=variant, via="bridge")
