"""expert-keys in a user's job: the Megatron-Core targets (:mod:`.core`, binding :mod:`.keys`' functions,
reading old layouts with :mod:`.old_layouts`), Megatron-Bridge's binding (:mod:`.bridge`) and NeMo 2's
reported gap (:mod:`.nemo`)."""
