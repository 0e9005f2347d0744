"""scheduler-override-group-lr's round trips (test and selftest processes only)."""
