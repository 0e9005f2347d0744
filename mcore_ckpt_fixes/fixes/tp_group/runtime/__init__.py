"""tp-group in a user's job: the probes and the wrappers that keep the TP group where 0.19 does (:mod:`.core`)."""
