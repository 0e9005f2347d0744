"""numpy2-product's round trips (test and selftest processes only)."""
