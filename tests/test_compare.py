"""The round trips' tensor comparison: 0.0 only for the same dtype, shape and bytes."""

from __future__ import annotations

import pytest

from mcore_ckpt_fixes.testing.compare import BITS_DIFFER, max_abs_delta


@pytest.mark.one_line
def test_exact_means_the_same_bits():
    import torch

    x = torch.tensor([0.0, 1.0, float("nan")])
    assert max_abs_delta(x, x.clone()) == 0.0  # a NaN equals the same NaN
    assert max_abs_delta(torch.tensor([0.0]), torch.tensor([-0.0])) == BITS_DIFFER  # a signed zero differs
    assert max_abs_delta(x[:2], x[:2].double()) == float("inf")  # a dtype change is not exact
    assert max_abs_delta(x[:2].bfloat16(), x[:2].float()) == float("inf")
    assert max_abs_delta(x[:2], torch.tensor([0.0, 3.0])) == 2.0
    assert max_abs_delta(x[:2], x[:1]) == float("inf")
    assert max_abs_delta(torch.tensor([1, 2]), torch.tensor([1, 5])) == 3.0
    assert max_abs_delta(torch.zeros(0), torch.zeros(0)) == 0.0
