"""hybrid-optimizer-fp32-params in a job: the probe and the wrapper of ``HybridDeviceOptimizer._update_fp32_params_by_new_state`` (core.py)."""
