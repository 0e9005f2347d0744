"""rng-under-ep in a user's job: one module per target (:mod:`.core` for Megatron-LM's training
checkpointing, :mod:`.bridge`, :mod:`.verl`, :mod:`.ms_swift`), and what they share: the
``fsdp_dtensor`` per-rank entry (:mod:`.fsdp_dtensor`) and the reading of the old 2-D layout
(:mod:`.old_layouts`)."""
