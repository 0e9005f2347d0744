"""fsdp2-swiglu-split, what runs in a job once the probe finds the bug (runtime/core.py)."""
