"""dtensor-placement in a user's job: the probes, the layout of a DTensor from its own mesh and the
replacement helpers (:mod:`.core`), and the helper they call for a sharded DTensor, which the source diff
carries verbatim (:mod:`.shard`)."""
