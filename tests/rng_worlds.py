"""rng-under-ep's worlds and comparisons, as its tests on Megatron-LM (tests/fixes/test_rng_under_ep.py)
and on each framework (tests/frameworks: bridge, verl, ms-swift) run them: one world per call (fix off
through ``MCORE_CKPT_FIXES=off``), RNG states compared per component."""

from mcore_ckpt_fixes.testing.launcher import run_world, values


class RngWorlds:
    """The worlds of one module of round trips (``scenarios``: its dotted name), whose results hold
    the RNG ``components`` named there."""

    def __init__(self, scenarios: str, components, timeout: float):
        self.scenarios, self.components, self.timeout = scenarios, components, timeout

    def world(self, func, patched, ckpt_dir, nproc=2, **kwargs):
        env = {} if patched else {"MCORE_CKPT_FIXES": "off"}
        kwargs = {"ckpt_dir": str(ckpt_dir), "patched": patched, **kwargs}
        return values(run_world(f"{self.scenarios}:{func}", nproc, kwargs, env=env, timeout=self.timeout))

    @staticmethod
    def delta(a, b):
        from mcore_ckpt_fixes.fixes.rng_under_ep.checks.core import delta

        return delta(a, b)

    def same(self, a, b):
        from mcore_ckpt_fixes.fixes.rng_under_ep.checks.core import same_states

        return same_states(a, b, self.components)

    def ranks_differ(self, saved):
        from mcore_ckpt_fixes.fixes.rng_under_ep.checks.core import assert_ranks_differ

        assert_ranks_differ(saved, self.components)

    @staticmethod
    def ok(results):
        """``results``, after asserting every rank completed its round trip."""
        for rank, r in enumerate(results):
            assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        return results
