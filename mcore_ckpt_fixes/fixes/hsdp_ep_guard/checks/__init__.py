"""hsdp-ep-guard's round trip, for the tests and ``selftest`` only (:mod:`.scenarios` registers it)."""
