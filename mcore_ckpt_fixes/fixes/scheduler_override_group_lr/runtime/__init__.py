"""scheduler-override-group-lr in a job: the probe and the wrappers of ``OptimizerParamScheduler.__init__`` and ``load_state_dict`` (core.py)."""
