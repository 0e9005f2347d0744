"""dist-optim-mixed-dtype-order's round trips (test and selftest processes only)."""
