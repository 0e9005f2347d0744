"""hybrid-optimizer-common-state, the round trips run by the tests and selftest (never by a job)."""
