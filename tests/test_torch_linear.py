"""codegen/torch_linear.py: MKL's packed sgemm against torch.nn.functional.linear, with and without a
bias, at other row counts than the one it packed for, and the addmm path for other dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from portlayer.codegen.torch_linear import packed_linear


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_linear_at_any_row_count(bias):
    torch.manual_seed(0)
    w, b = torch.randn(48, 40), (torch.randn(48) if bias else None)
    for rows in (17, 1, 64, 0):  # packed on the first call (17 rows), reused after
        x = torch.randn(rows, 40)
        torch.testing.assert_close(packed_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_other_dtypes_keep_addmm():
    x, w, b = torch.randn(5, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64), None
    torch.testing.assert_close(packed_linear(x, w, b), F.linear(x, w))
    assert not hasattr(w, "_portlayer_mkl_packed")
