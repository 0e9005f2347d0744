"""rerun-state-constant-structure's round trips (test and selftest processes only)."""
