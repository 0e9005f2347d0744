"""Distributed scenarios run by :mod:`mcore_ckpt_fixes.harness` (one module per fix)."""
