"""dp-reshardable-padding, what runs in a job once the probe finds the bug (runtime/core.py)."""
