"""dist-optim-mixed-dtype-order in a job: the probe and the wrapper of ``DistributedOptimizer._build_optimizer_group_ranges`` (core.py)."""
