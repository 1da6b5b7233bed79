"""An aten op without a mapping fails naming the op, its FX node and the HF module path."""

from __future__ import annotations

import pytest
import torch

from portlayer.flatten import capture
from portlayer.flatten.from_export import UnsupportedOpError


class FlipAct(torch.nn.Module):
    """An activation through an op portlayer has no mapping for (aten.flip)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flip(x, dims=(-1,))


def test_unmapped_op_names_op_node_and_module(tiny_dirs):
    from conftest import hf_model

    model = hf_model(tiny_dirs["tiny-llama"])
    model.model.layers[1].mlp.act_fn = FlipAct()
    with pytest.raises(UnsupportedOpError) as err:
        capture(model)
    msg = str(err.value)
    assert "aten.flip" in msg
    assert "FX node 'flip" in msg
    assert "model.layers.1.mlp.act_fn" in msg
