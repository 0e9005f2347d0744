"""The worker's stand-in for Transformer Engine's ``quantize_param_shard`` (testing/_standins.py),
on module objects shaped as ``megatron.core.fp8_utils``: 0.12's fallback without Transformer Engine
raises for every call, 0.13's returns for an empty list. The real 0.12 wheels are run by selftest
(docs/releases.md's sweep), not on the CI lines."""

import types

import pytest

from mcore_ckpt_fixes.testing._standins import empty_list_stand_in

pytestmark = pytest.mark.one_line  # the whole matrix runs it on one line (tools/test.sh)


def _module(fallback):
    return types.SimpleNamespace(_quantize_param_shard_impl=fallback)


def _refuses_everything(*args, **kwargs):  # 0.12's fallback
    raise RuntimeError("Invalid Transformer Engine version for FP8 distributed optimizer")


def test_an_empty_list_passes_and_fp8_parameters_still_raise_as_the_release():
    fp8_utils = _module(_refuses_everything)
    empty_list_stand_in(fp8_utils)
    assert fp8_utils._quantize_param_shard_impl([], [], [], None) is None
    with pytest.raises(RuntimeError, match="Invalid Transformer Engine version"):
        fp8_utils._quantize_param_shard_impl(["an fp8 parameter"], [], [], None)
    installed = fp8_utils._quantize_param_shard_impl
    empty_list_stand_in(fp8_utils)  # twice: one stand-in
    assert fp8_utils._quantize_param_shard_impl is installed


def test_a_fallback_that_takes_an_empty_list_is_left_as_it_is():
    def takes_empty(model_params, *args, **kwargs):  # 0.13's fallback, or Transformer Engine's
        if len(model_params) == 0:
            return None
        raise RuntimeError("Invalid Transformer Engine version for FP8 distributed optimizer")

    fp8_utils = _module(takes_empty)
    empty_list_stand_in(fp8_utils)
    assert fp8_utils._quantize_param_shard_impl is takes_empty
