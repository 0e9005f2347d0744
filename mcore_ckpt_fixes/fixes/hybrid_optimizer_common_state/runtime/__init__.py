"""hybrid-optimizer-common-state, what runs in a job once the probe finds the bug (runtime/core.py)."""
