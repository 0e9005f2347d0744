"""numpy2-product: both halves where the release calls ``np.product`` (0.12.0-0.15.x, run with
``tools/test.sh <release> -- tests/fixes/test_numpy2_product.py``; CI's four lines are 0.16.1 and
later, where the module skips), one warm world each (2 gloo ranks, both cases): a GPT under
Megatron's DDP saved and loaded through the fully parallel strategies, alone and with the
distributed optimizer in the release's default format
(mcore_ckpt_fixes/fixes/numpy2_product/checks/core.py). The probe and the bound ``np`` are checked
on every line.
"""

import numpy
import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.numpy2_product import FIX, MODULES
from mcore_ckpt_fixes.fixes.numpy2_product.checks import scenarios as sc
from mcore_ckpt_fixes.fixes.numpy2_product.checks.core import CASES, USED
from mcore_ckpt_fixes.fixes.numpy2_product.runtime import numpy_with_product
from mcore_ckpt_fixes.testing import for_fix

CORE = "mcore_ckpt_fixes.fixes.numpy2_product.checks.core"
NUMPY2 = int(numpy.__version__.split(".")[0]) >= 2


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:cases", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


@pytest.mark.parametrize("case", CASES)
def test_unpatched_save_stops_on_np_product(worlds, mcore_version, case):
    results = [w[case] for w in worlds[False]]
    for rank, r in enumerate(results):
        assert set(r["fix_state"].values()) == {"disabled"}, (rank, r["fix_state"])
        if not NUMPY2:  # NumPy 1 has np.product: nothing to fix, the round trip is exact
            assert r["error"] is None and not any(r["max_delta"].values()), (rank, r["error"])
    if not NUMPY2:
        return
    if case == "model":  # every rank sizes its shards for the exchange
        assert for_fix(FIX.id)[0].bug_for(mcore_version).seen_in(results), [r["error"] for r in results]
        assert all("_shard_size" in r["traceback"] for r in results)
        return
    # Rank 0 checks the flattened shards' coverage while rank 1 waits for it in a collective.
    first, other = results
    assert (first["phase"], first["error"]) == (sc.NO_PRODUCT.phase, sc.NO_PRODUCT.error), first.get("traceback")
    assert "_validate_sharding_for_key_flattened" in first["traceback"]
    # ... and loses its peer there: the lost connection, nothing else.
    assert other["phase"] == "save" and other["error"].startswith("RuntimeError: ["), other
    assert "Connection closed by peer" in other["error"] or "Connection reset by peer" in other["error"], other


@pytest.mark.parametrize("case", CASES)
def test_patched_round_trip_is_exact(worlds, case):
    expected = {"model"} | ({"main", "exp_avg", "exp_avg_sq", "next"} if CASES[case] else set())
    for rank, r in enumerate(w[case] for w in worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {m: "applied" if NUMPY2 else "not-needed" for m in USED}, (rank, r["fix_state"])
        assert {k.split("/")[0] for k in r["max_delta"]} == expected, (rank, sorted(r["max_delta"]))
        assert set(r["max_delta"].values()) == {0.0}, (rank, {k: d for k, d in r["max_delta"].items() if d})


def test_bound_numpy_is_numpy_with_product():
    assert numpy_with_product.product is numpy.prod
    assert numpy_with_product.ndarray is numpy.ndarray and numpy_with_product.zeros is numpy.zeros
    assert numpy_with_product.__version__ == numpy.__version__


@pytest.mark.parametrize("module_name", MODULES)
def test_probe(mcore_version, module_name):
    import importlib

    from mcore_ckpt_fixes.fixes.numpy2_product.runtime import core

    module = importlib.import_module(module_name)
    verdict, why = core.probe(module)  # the release's own code with the release's NumPy, even after apply
    if mcore_version in FIX.specifiers:
        assert verdict is NUMPY2, why
    else:  # 0.16.0 on: np.prod where one remains, the function gone where it does not
        assert verdict is (False if module_name.endswith("exchange_utils") else None), why
