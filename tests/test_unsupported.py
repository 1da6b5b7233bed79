"""An aten op without a mapping fails naming the op, its FX node and the HF module path."""

from __future__ import annotations

import pytest
import torch

from portlayer.flatten import capture
from portlayer.flatten.from_export import UnsupportedOpError


class CumsumAct(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, dim=-1)


def test_unmapped_op_names_op_node_and_module(tiny_dirs):
    from conftest import hf_model

    model = hf_model(tiny_dirs["tiny-llama"])
    model.model.layers[1].mlp.act_fn = CumsumAct()
    with pytest.raises(UnsupportedOpError) as err:
        capture(model)
    msg = str(err.value)
    assert "aten.cumsum" in msg
    assert "FX node 'cumsum" in msg
    assert "model.layers.1.mlp.act_fn" in msg
