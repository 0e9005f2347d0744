"""rerun-state-strict-load's round trips (test and selftest processes only)."""
