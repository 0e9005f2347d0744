"""One package per fix (``fixes/<fix>/``), whose ``__init__`` defines ``FIX = Fix(...)``; the engine discovers them.

Every fix package has the same inner shape (``runtime/`` runs in a job, ``diff/`` builds the source
diffs, ``checks/`` tests): CONTRIBUTING.md, "Adding a fix".

ORDER is the one place the fixes' order is declared: the order ``status`` lists them in (that of
docs/fixes.md and the README's list), and the order of their layers where several fixes replace one
attribute (a fix listed earlier sits lower, nearer the release's code; each layer calls the one
below it: ``engine.patching.below``).
"""

ORDER = (
    "tp-group",
    "mimo-optimizer",
    "gdn-fsdp-split",
    "dtensor-placement",
    "expert-keys",
    # Below rng-under-ep's layer on _load_global_dist_base_checkpoint, which reads the state dict
    # this one hands on alone.
    "strictness-return-keys",
    "rng-under-ep",
    "hsdp-ep-guard",
    "torch-adam-step",
    "dist-optim-state",
    "fully-reshardable-buckets",
    "dp-reshardable-padding",
    "param-group-identity",
    "chained-optim-main-params-split",
    "rerun-state-constant-structure",
    "legacy-save-writers",
    "rerun-transient-checkpoint",
    "load-main-params-substring-match",
    "numpy2-product",
    "fsdp2-swiglu-split",
    "hybrid-optimizer-fp32-params",
    "hybrid-optimizer-fp32-shards",
    "hybrid-optimizer-common-state",
    "dist-optim-mixed-dtype-order",
    "rerun-state-strict-load",
    "scheduler-override-group-lr",
    "fsdp-dtensor-pp-guard",
    "scheduler-checkpoint-wd",
    "model-load-fallback",
    "float16-optim-fp32-params",
    "factory-merges-non-strict",
    "hybrid-optimizer-fresh-load",
    "persistent-worker-failure",
    "hybrid-optimizer-gpu-step",
    "persistent-worker-cpu-snapshot",
    "hybrid-optimizer-dp-zero-load",
    "forked-save-writers",
    "hybrid-optimizer-chained-step",
    "float16-optim-fresh-save",
    "remove-sharded-tensors",
    "async-save-pinned-buffers",
    "ep-change-optimizer-chain",
    "fused-adam-group-step",
)
