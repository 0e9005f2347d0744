"""hybrid-optimizer-fp32-shards' round trips (test and selftest processes only)."""
