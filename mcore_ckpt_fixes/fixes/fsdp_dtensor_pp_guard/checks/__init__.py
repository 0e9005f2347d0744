"""fsdp-dtensor-pp-guard's round trip (scenarios.py light; core.py runs in the worlds)."""
