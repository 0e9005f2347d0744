"""A CPU stand-in with Apex ``FusedAdam``'s interface, so Megatron takes its GPU optimizer path.

Megatron-Core picks its Adam at import: Transformer Engine's or Apex's ``FusedAdam`` where one
imports, else torch's ``AdamW``. The two paths checkpoint differently: FusedAdam keeps the step
count in each param group (``group["step"]``) and only the moments per parameter, torch's Adam
keeps a ``step`` tensor per parameter, and ``DistributedOptimizer`` has a branch for each. Users
train on the FusedAdam path; neither package installs without CUDA. This class does what
``apex.optimizers.FusedAdam`` does (Adam or AdamW, bias correction, the step per group) with
plain torch ops, and :func:`optimizer_path` makes Megatron's optimizer modules see it as Apex's.
Used only in resume-check worker processes, never by ``import mcore_ckpt_fixes``.
"""

from __future__ import annotations

import contextlib

import torch


class FusedAdam(torch.optim.Optimizer):
    """Apex ``FusedAdam``'s constructor and state layout, computed with plain torch ops."""

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
        capturable=False,
        master_weights=False,
    ):
        if amsgrad or capturable or master_weights:
            raise ValueError("the FusedAdam stand-in supports neither amsgrad, capturable nor master_weights")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            # Apex counts steps per group, and only for groups that have parameters: a group the
            # distributed optimizer left empty on this rank keeps the step it had (none, or a
            # loaded one), which Megatron 0.14+ aligns across the groups when it saves.
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p, group):
        state = self.state[p]
        if len(state) == 0:
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        step, lr, wd = group["step"], group["lr"], group["weight_decay"]
        grad = p.grad.float()
        if not self.adam_w_mode and wd != 0:
            grad = grad + wd * p
        state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        c1 = 1 - beta1**step if group["bias_correction"] else 1.0
        c2 = 1 - beta2**step if group["bias_correction"] else 1.0
        update = (state["exp_avg"] / c1) / ((state["exp_avg_sq"] / c2).sqrt() + group["eps"])
        if self.adam_w_mode and wd != 0:
            update = update + wd * p
        p.add_(update, alpha=-lr)


class FusedSGD(torch.optim.SGD):
    """Apex ``FusedSGD``'s name (Megatron imports it beside FusedAdam); torch's SGD does the work."""


# (module, attribute, value): what Megatron-Core's optimizer modules decide at import, as they
# decide it with Apex installed and with neither Apex nor Transformer Engine. Attributes a release
# does not have are left alone.
def _globals(apex: bool):
    return (
        ("megatron.core.optimizer", "Adam", FusedAdam if apex else torch.optim.AdamW),
        ("megatron.core.optimizer", "SGD", FusedSGD if apex else torch.optim.SGD),
        ("megatron.core.optimizer", "USING_PYTORCH_OPTIMIZER", not apex),
        ("megatron.core.optimizer.distrib_optimizer", "Adam", FusedAdam if apex else torch.optim.Adam),
        ("megatron.core.optimizer.distrib_optimizer", "HAVE_APEX_OR_TE", apex),
        ("megatron.core.optimizer.distrib_optimizer", "USING_APEX_OPTIMIZER", apex),
        ("megatron.core.optimizer.distrib_optimizer", "USING_TE_OPTIMIZER", False),
    )


@contextlib.contextmanager
def optimizer_path(apex: bool):
    """Megatron's optimizer modules behave as with Apex installed (``apex=True``: the stand-in
    above) or as with neither Apex nor Transformer Engine (torch's Adam), inside the block."""
    import importlib

    saved = []
    try:
        for module_name, attr, value in _globals(apex):
            module = importlib.import_module(module_name)
            if hasattr(module, attr):
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


def _installed_fused_adam() -> bool:
    """Whether this host has a FusedAdam Megatron takes of its own (Apex's or Transformer Engine's)."""
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in ("apex", "transformer_engine"))


def job_path(fused_adam: bool, on_cpu: bool):
    """The Adam a training job takes (``fused_adam``: Megatron's FusedAdam path, else torch's): on a
    GPU host the installed Apex's or Transformer Engine's FusedAdam; a host with neither (any CPU
    host, a GPU host they cannot be installed on) gets the stand-in, on the host's tensors.
    :func:`path_in_use` says which one a run took."""
    if on_cpu or not fused_adam or not _installed_fused_adam():
        return optimizer_path(apex=fused_adam)
    return contextlib.nullcontext()


def path_in_use() -> str:
    """Which Adam Megatron's optimizer builds now: ``FusedAdam stand-in`` (this module's),
    ``apex FusedAdam``, ``transformer_engine FusedAdam`` or ``torch AdamW`` (the fallback)."""
    import megatron.core.optimizer as optimizer

    adam = optimizer.Adam
    if adam is FusedAdam:
        return "FusedAdam stand-in"
    return f"{adam.__module__.partition('.')[0]} {adam.__name__}"
