"""Multi-process round-trip harness shared by the test suite and ``selftest``.

Nothing here is imported by ``import mcore_ckpt_fixes``; CPU shims are installed only in workers.
"""
