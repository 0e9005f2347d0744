"""hybrid-optimizer-fp32-params's round trips (test and selftest processes only)."""
