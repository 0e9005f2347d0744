"""gdn-fsdp-split in a user's job: the probe and ``apply`` (:mod:`.core`), and the replacement they bind
(:mod:`.split`)."""
