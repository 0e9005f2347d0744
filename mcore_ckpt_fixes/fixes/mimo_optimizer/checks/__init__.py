"""mimo-optimizer's round trips, for the tests and ``selftest`` only (:mod:`.scenarios` registers them)."""
