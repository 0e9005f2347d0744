"""What the package logs, and where: a job of 1,024 ranks must be able to live with it.

* At most one INFO line per process, the summary of what was applied, and only on global rank 0
  (every other rank logs the same summary at DEBUG).
* Every decision (each target applied, not needed, not applicable, and why) at DEBUG, on every rank.
* A warning only where this rank's own state is affected (the callers decide).

The global rank is read without importing anything: torch.distributed's once a process group is
initialised, else the launcher's variables (``RANK`` from torchrun and Megatron's launchers, then
MPI's and Slurm's). A process that none of them names is a job of its own: rank 0.
"""

from __future__ import annotations

import os
import sys

NAME = "mcore_ckpt_fixes"
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def logger():
    import logging  # lazily: logging alone costs ~10 % of this package's import budget

    return logging.getLogger(NAME)


def global_rank():
    """This process's global rank, or None when nothing names one."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # a half-initialised torch: fall back to the launcher's word
        pass
    for variable in _RANK_VARIABLES:
        value = os.environ.get(variable, "").strip()
        if value.isdigit():
            return int(value)
    return None


def first_rank() -> bool:
    """Is this the process whose INFO lines speak for the job (global rank 0, or no job at all)?"""
    return global_rank() in (None, 0)


def detail(message: str, *args) -> None:
    """A decision's details: DEBUG, on every rank."""
    logger().debug(message, *args)


def once_per_job(message: str, *args) -> None:
    """INFO on global rank 0, DEBUG on every other rank."""
    import logging

    logger().log(logging.INFO if first_rank() else logging.DEBUG, message, *args)
