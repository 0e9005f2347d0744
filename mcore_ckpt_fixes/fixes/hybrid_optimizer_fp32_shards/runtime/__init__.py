"""hybrid-optimizer-fp32-shards in a job: the probe and the wrapper of ``DistributedOptimizer._build_model_and_main_param_groups`` (core.py)."""
