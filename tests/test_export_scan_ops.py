"""torch.diff and torch.cumsum through torch.export into the Flat IR (transformers' mask code takes them of position
ids to find packed sequences), checked against torch on static and dynamic shapes."""

from __future__ import annotations

import pytest
import torch

from portlayer.flatten.from_export import convert_exported_program
from portlayer.flatten.interpret import run_graph


class Scan(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


CASES = {
    "diff": lambda x: torch.diff(x, dim=-1),
    "diff_prepend": lambda x: torch.diff(x, prepend=x[:, :1] - 1, dim=-1),
    "diff_n2_append_dim0": lambda x: torch.diff(x, n=2, dim=0, append=x[:1]),
    "diff_bool": lambda x: torch.diff(x > 0, dim=-1).to(torch.int64),
    "cumsum_int": lambda x: torch.cumsum(x, -1),
    "cumsum_bool": lambda x: (torch.diff(x, prepend=x[:, :1] - 1, dim=-1) != 1).cumsum(-1),
    "cumsum_dim0": lambda x: torch.cumsum(x, 0),
}


def _matches_torch(fn, dynamic: bool, min_tokens: int) -> None:
    """fn exported on a [3, 7] int tensor (dim 1 symbolic when ``dynamic``), converted, run on the IR interpreter
    at 7 (and 12) columns: equal to fn itself, dtype included."""
    torch.manual_seed(0)
    x = torch.randint(-3, 9, (3, 7))
    dims = {"x": {1: torch.export.Dim("num_tokens", min=min_tokens, max=64)}} if dynamic else None
    g = convert_exported_program(torch.export.export(Scan(fn), (x,), dynamic_shapes=dims))
    for t in ((7, 12) if dynamic else (7,)):
        xv = torch.randint(-3, 9, (3, t))
        (ours,) = run_graph(g, {g.inputs[0].name: xv}, None)
        want = fn(xv)
        assert ours.dtype == want.dtype and torch.equal(ours, want), (t, ours, want)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dynamic", [False, True])
def test_scan_ops_match_torch(name: str, dynamic: bool) -> None:
    _matches_torch(CASES[name], dynamic, min_tokens=3)  # diff's T - 1 must not be specialised to 1


INDEX_CASES = {
    "rows_cols": lambda x: x[torch.arange(x.shape[0])[:, None], torch.arange(x.shape[1])[None, :]],
    "broadcast_pairs": lambda x: x[torch.zeros(5, 1, dtype=torch.long), torch.arange(x.shape[1])] * 2,
    "trailing_dim": lambda x: x.reshape(x.shape[0], x.shape[1], 1).expand(-1, -1, 2)[
        torch.tensor([2, 0]), torch.tensor([1, 3])],
}


@pytest.mark.parametrize("name", sorted(INDEX_CASES))
@pytest.mark.parametrize("dynamic", [False, True])
def test_indexing_by_adjacent_index_tensors_matches_torch(name: str, dynamic: bool) -> None:
    """x[i, j] with two index tensors (transformers' packed-sequence mask: mask[batch_idx, q_idx])."""
    _matches_torch(INDEX_CASES[name], dynamic, min_tokens=4)


def test_and_or_of_bool_masks_match_torch_and_integer_bitwise_is_refused() -> None:
    from portlayer.flatten.from_export import UnsupportedOpError

    x = torch.randint(-3, 9, (3, 7))
    g = convert_exported_program(torch.export.export(Scan(lambda x: ((x > 0) & (x < 5)) | (x == -2)), (x,)))
    (ours,) = run_graph(g, {g.inputs[0].name: x}, None)
    assert torch.equal(ours, ((x > 0) & (x < 5)) | (x == -2))
    with pytest.raises(UnsupportedOpError, match="non-bool"):
        convert_exported_program(torch.export.export(Scan(lambda x: x & 6), (x,)))


FLOAT_ROWS = [  # finite values, then rows with +inf, -inf, both, and a nan at different places
    [0.5, -1.25, 3.0, 2.0, -0.75, 1.5, 4.0],
    [1.0, float("inf"), 2.0, -3.0, 1.0, 0.5, 2.0],
    [float("-inf"), 1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
    [1.0, 2.0, float("inf"), 3.0, float("-inf"), 1.0, 1.0],
    [1.0, 2.0, 3.0, float("nan"), 1.0, 2.0, 3.0],
    [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, float("inf")],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("dim", [-1, 0])
@pytest.mark.parametrize("dynamic", [False, True])
def test_cumsum_of_floats_keeps_infinities_and_nans_where_torch_has_them(dtype, dim, dynamic) -> None:
    """Float cumsum: an inf or nan goes where a running sum puts it (a plain triangular matmul would multiply it by 0
    and turn the whole row into nan); the finite values match torch.cumsum within rounding."""
    x = torch.tensor(FLOAT_ROWS, dtype=dtype)
    dims = {"x": {1: torch.export.Dim("num_tokens", min=3, max=64)}} if dynamic else None
    g = convert_exported_program(torch.export.export(Scan(lambda x: torch.cumsum(x, dim)), (x,), dynamic_shapes=dims))
    cases = [x] + ([torch.cat([x, x[:, :5].flip(-1)], dim=1)] if dynamic else [])
    for xv in cases:
        (ours,) = run_graph(g, {g.inputs[0].name: xv}, None)
        want = torch.cumsum(xv, dim)
        assert ours.dtype == want.dtype and ours.shape == want.shape
        assert torch.equal(ours.isnan(), want.isnan()) and torch.equal(ours.isinf(), want.isinf()), (ours, want)
        fin = want.isfinite()
        assert torch.equal(ours[~fin & ~want.isnan()], want[~fin & ~want.isnan()])  # the same sign of infinity
        tol = 1e-2 if dtype == torch.float16 else 1e-5
        torch.testing.assert_close(ours[fin], want[fin], rtol=tol, atol=tol)



@pytest.mark.parametrize("case", ["fp16_into_fp32", "float_into_int64", "int32_into_fp16", "scalar"])
def test_cumsum_with_a_dtype_casts_first_then_sums_as_torch_does(case) -> None:
    """torch.cumsum(x, dtype=d) casts x to d and sums in d: fp16 values whose sum overflows fp16 stay finite in
    float32, floats summed as int64 are truncated first; a 0-d tensor is its own cumulative sum."""
    x, fn = {
        "fp16_into_fp32": (torch.tensor([[60000.0, 60000.0, -60000.0]] * 2, dtype=torch.float16),
                           lambda x: torch.cumsum(x, -1, dtype=torch.float32)),
        "float_into_int64": (torch.tensor([[1.7, 2.6, 3.5]] * 2), lambda x: torch.cumsum(x, -1, dtype=torch.int64)),
        "int32_into_fp16": (torch.tensor([[1, 2, 3]] * 2, dtype=torch.int32), lambda x: torch.cumsum(x, 1, dtype=torch.float16)),
        "scalar": (torch.tensor([3.0, 4.0]), lambda x: torch.cumsum(x.sum(), 0)),
    }[case]
    g = convert_exported_program(torch.export.export(Scan(fn), (x,)))
    (ours,) = run_graph(g, {g.inputs[0].name: x}, None)
    want = fn(x)
    assert ours.dtype == want.dtype and ours.shape == want.shape and torch.equal(ours, want), (ours, want)
