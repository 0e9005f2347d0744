"""param-group-identity, what runs in a job once the probe finds the bug (runtime/core.py)."""
