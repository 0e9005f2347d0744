"""fsdp-dtensor-pp-guard in a job: the guard on ``_load_base_checkpoint`` and its probe."""
