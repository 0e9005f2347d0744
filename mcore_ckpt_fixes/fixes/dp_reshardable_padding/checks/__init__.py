"""dp-reshardable-padding, the round trips run by the tests and selftest (never by a job)."""
