"""One package per fix (``fixes/<fix>/``), whose ``__init__`` defines ``FIX = Fix(...)``; the engine discovers them.

ORDER only fixes the order ``status`` lists them in (that of the fix table in README.md).
"""

ORDER = (
    "tp-group",
    "mimo-optimizer",
    "gdn-fsdp-split",
    "dtensor-placement",
    "expert-keys",
    "rng-under-ep",
    "hsdp-ep-guard",
    "torch-adam-step",
)
