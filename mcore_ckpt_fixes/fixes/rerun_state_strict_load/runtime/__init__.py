"""rerun-state-strict-load in a job: the probe and the wrapper of dist_checkpointing's mismatch check (core.py)."""
