"""rerun-transient-checkpoint's round trips (test and selftest processes only)."""
