"""Read each layer's real attention mask from HF's mask builders, as data.

HF's eager attention applies whatever mask ``masking_utils`` built for the layer (causal,
sliding window, bidirectional local window, chunked ...), while the ``sliding_window`` /
``is_causal`` arguments and module attributes are hints for other kernels that some models
set inconsistently (ModernBERT passes a one-sided ``sliding_window`` for a two-sided mask;
a module may carry a window its layer never applies). So before export, capture runs the
model once eagerly with a mask implementation that does not build a mask but evaluates the
layer's ``mask_function`` on index grids and returns a :class:`MaskSpec`; the attention hook
then takes the layer's causal flag and window from it. A mask that is not one of the forms
the attention op expresses is reported as such, never approximated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

IMPL_NAME = "portlayer"
_FULL_GRID = 160  # every (q, kv) pair below this is checked exactly


@dataclass(frozen=True)
class MaskSpec:
    """A layer's mask in the attention op's terms (``error`` set when it has none)."""

    causal: bool = True
    sliding_window: int | None = None  # causal: q - kv < w; bidirectional: |q - kv| < w
    error: str | None = None


def _grid(fn: Callable, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.long)
    out = fn(zero, zero, rows[:, None], cols[None, :])
    return torch.as_tensor(out, dtype=torch.bool).expand(rows.numel(), cols.numel())


def _expected(spec: MaskSpec, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    q, kv = rows[:, None], cols[None, :]
    keep = torch.ones(rows.numel(), cols.numel(), dtype=torch.bool)
    if spec.causal:
        keep &= kv <= q
    if spec.sliding_window:
        keep &= (q - kv < spec.sliding_window) if spec.causal else ((q - kv).abs() < spec.sliding_window)
    return keep


def infer_mask_spec(mask_function: Callable, extent: int) -> MaskSpec:
    """Fit (causal, window) to ``mask_function`` over ``extent`` positions and prove the fit.

    The window is read off the first and last rows, then the whole fit is compared with the
    function on a full small grid and on sampled rows over the full extent; any difference
    (chunked attention, asymmetric windows, per-token overlays) gives ``MaskSpec(error=...)``.
    """
    n = max(int(extent), _FULL_GRID)
    cols = torch.arange(n)
    try:
        first = _grid(mask_function, torch.tensor([0]), cols)[0]
        last = _grid(mask_function, torch.tensor([n - 1]), cols)[0]
    except Exception as e:  # an overlay that needs batch data or vmap
        return MaskSpec(error=f"its mask function could not be evaluated on index grids ({type(e).__name__}: {e})")
    if not bool(last[n - 1]) or not bool(first[0]):
        return MaskSpec(error="its mask hides a token from itself")
    left_lo = int(last.nonzero().min())
    right_hi = int(first.nonzero().max())
    left = None if left_lo == 0 else n - 1 - left_lo
    right = None if right_hi == n - 1 else right_hi
    if right == 0:
        spec = MaskSpec(causal=True, sliding_window=None if left is None else left + 1)
    elif left is None and right is None:
        spec = MaskSpec(causal=False)
    elif left is not None and left == right:
        spec = MaskSpec(causal=False, sliding_window=left + 1)
    else:
        return MaskSpec(error=f"its mask reaches {left} tokens back and {right} ahead, which the attention op "
                              "cannot express (it has causal windows and symmetric two-sided windows)")
    small = torch.arange(min(n, _FULL_GRID))
    gen = torch.Generator().manual_seed(0)
    rows = torch.unique(torch.cat([torch.tensor([0, n // 2, n - 1]), torch.randint(0, n, (13,), generator=gen)]))
    for r, c in ((small, small), (rows, cols)):
        if not torch.equal(_grid(mask_function, r, c), _expected(spec, r, c)):
            return MaskSpec(error="its mask is not a causal or local-window mask (chunked attention or a custom "
                                  "overlay?), which the attention op cannot express")
    return spec


def _probe_mask(*, mask_function: Callable, config: Any = None, **_: Any) -> MaskSpec:
    """AttentionMaskInterface entry used only during the probe forward."""
    extent = int(getattr(config, "max_position_embeddings", 0) or 0) if config is not None else 0
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions"):
        extent = max(extent, int(getattr(text, name, 0) or 0))
    return infer_mask_spec(mask_function, min(max(extent, _FULL_GRID), 1 << 17))


@contextmanager
def recording_masks(model: torch.nn.Module) -> Iterator[None]:
    """While active, HF's mask builders hand each layer a MaskSpec instead of a mask."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    for m in model.modules():
        m.__dict__.pop("_portlayer_mask", None)
    mapping = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    before = mapping.get(IMPL_NAME)
    mapping[IMPL_NAME] = _probe_mask
    try:
        yield
    finally:
        if before is None:
            mapping.pop(IMPL_NAME, None)
        else:
            mapping[IMPL_NAME] = before
