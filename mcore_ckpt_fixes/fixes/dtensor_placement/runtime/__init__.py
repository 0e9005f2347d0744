"""dtensor-placement in a user's job: the probes, the layout of a DTensor from its own mesh and the
replacement helpers (:mod:`.core`)."""
