"""mimo-optimizer in a user's job: the probe and the MimoOptimizer / ``dist_checkpointing.load`` wrappers
(:mod:`.core`), each module's common state (:mod:`.common_state`) and the reading of what unfixed
0.17/0.18 wrote (:mod:`.old_layouts`)."""
