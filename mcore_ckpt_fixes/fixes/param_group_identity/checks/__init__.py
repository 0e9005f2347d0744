"""param-group-identity, the round trips run by the tests and selftest (never by a job)."""
