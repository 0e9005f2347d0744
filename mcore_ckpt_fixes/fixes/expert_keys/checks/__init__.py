"""expert-keys' round trips, for the tests and ``selftest`` only (:mod:`.scenarios` registers them)."""
