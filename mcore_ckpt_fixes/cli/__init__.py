"""Command implementations behind ``python -m mcore_ckpt_fixes``."""
