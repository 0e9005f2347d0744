"""hsdp-ep-guard in a user's job: the probe, the guarded ``_init_dist_index`` and its message (:mod:`.core`)."""
