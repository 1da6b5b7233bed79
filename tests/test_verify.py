"""The verifier catches each kind of broken rule, names the node, and lists all problems."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from ir_samples import tiny_decoder

from portlayer.flatten.ir import Graph, Node, TensorType, Value
from portlayer.flatten.printer import parse_graph
from portlayer.flatten.verify import VerificationError, verify_graph


def test_valid_graphs_pass() -> None:
    verify_graph(tiny_decoder())
    verify_graph(tiny_decoder(tied=False))
    g = tiny_decoder()
    g.weights = {}  # params without weights are fine (a parsed graph has none)
    verify_graph(g)


def _swap_first_two_layer_nodes(g: Graph) -> None:
    i = [n.name for n in g.nodes].index("q_proj")
    g.nodes[i], g.nodes[i - 1] = g.nodes[i - 1], g.nodes[i]


def _set(node: str, **changes) -> Callable[[Graph], None]:
    def f(g: Graph) -> None:
        i = [n.name for n in g.nodes].index(node)
        g.nodes[i] = g.nodes[i].clone(**changes)

    return f


F32 = TensorType("float32", ("num_tokens", 16))

BREAKS: list[tuple[str, Callable[[Graph], None], str]] = [
    ("output-shadows-input", _set("act", outputs=[Value("input_ids", TensorType("float32", ("num_tokens", 24)))]),
     "node act: value 'input_ids' is already defined by input input_ids"),
    ("output-shadows-param", _set("norm", outputs=[Value("model_norm_weight", F32)]),
     "value 'model_norm_weight' is already defined by param model_norm_weight"),
    ("produced-twice", _set("o_proj", outputs=[Value("q_proj", F32)]), "value 'q_proj' is already defined by node q_proj"),
    ("duplicate-node-name", _set("k_proj", name="q_proj"), "node q_proj: the node name is used by an earlier node"),
    ("use-before-def", _swap_first_two_layer_nodes, "input 0 'input_layernorm' is used before node input_layernorm defines it"),
    ("undefined-input", _set("act", inputs=["gate_projj"]), "node act (silu): input 0 'gate_projj' is not defined anywhere"),
    ("unknown-op", _set("act", op="swish"), "node act (swish): op 'swish' is not in the portable op registry"),
    ("unknown-attr", _set("act", attrs={"beta": 1.0}), "node act (silu): unknown attributes ['beta']"),
    ("wrong-output-type", _set("act", outputs=[Value("act", TensorType("float16", ("num_tokens", 24)))]),
     "node act (silu): output types [float16[num_tokens, 24]] differ from the registry's inference [float32[num_tokens, 24]]"),
    ("wrong-symbolic-dim", _set("act", outputs=[Value("act", TensorType("float32", ("2*num_tokens", 24)))]),
     "differ from the registry's inference"),
    ("wrong-output-count", _set("act", outputs=[Value("act", F32), Value("act2", F32)]), "node act (silu): has 2 outputs but silu produces 1"),
    ("inference-fails", _set("down_proj", inputs=["gate_proj", "model_layers_0_self_attn_q_proj_weight"]),
     "node down_proj (linear): type inference failed"),
    ("missing-required-input", _set("act", inputs=[None]), "node act (silu): type inference failed"),
    ("bad-name", _set("act", name="act-1"), "node name 'act-1' is not a Python identifier"),
    ("keyword-name", _set("act", outputs=[Value("lambda", TensorType("float32", ("num_tokens", 24)))]),
     "output name 'lambda' is not a Python identifier"),
    ("non-json-attr", _set("norm", attrs={"eps": torch.tensor(1e-5)}), "node norm (rms_norm): attrs['eps'] is a Tensor"),
    ("non-json-meta", _set("norm", meta={"dtype": torch.float32}), "node norm (rms_norm): meta['dtype'] is a dtype"),
    ("undefined-graph-output", lambda g: setattr(g, "outputs", ["logits", "hidden"]), "graph output 'hidden' is not defined"),
    ("weight-dtype", lambda g: g.weights.__setitem__("model_norm_weight", torch.ones(16, dtype=torch.float16)),
     "param model_norm_weight: weight is float16[16] but the param is declared float32[16]"),
    ("weight-shape", lambda g: g.weights.__setitem__("model_norm_weight", torch.ones(17)),
     "param model_norm_weight: weight is float32[17]"),
    ("weight-missing", lambda g: g.weights.pop("model_norm_weight"), "param model_norm_weight: no weight tensor"),
    ("weight-stray", lambda g: g.weights.__setitem__("ghost", torch.ones(1)), "weight 'ghost' has no entry in graph.params"),
    ("symbolic-param", lambda g: g.params.__setitem__("dyn", TensorType("float32", ("num_tokens",))),
     "param dyn: shape ['num_tokens'] is symbolic"),
]


@pytest.mark.parametrize("name,breaker,message", BREAKS, ids=[b[0] for b in BREAKS])
def test_each_violation_is_caught(name: str, breaker: Callable[[Graph], None], message: str) -> None:
    g = tiny_decoder()
    breaker(g)
    with pytest.raises(VerificationError) as e:
        verify_graph(g)
    assert any(message in p for p in e.value.problems), e.value.problems


def test_all_problems_are_listed_at_once() -> None:
    g = tiny_decoder()
    _set("act", op="swish")(g)
    _set("norm", inputs=["nowhere", "model_norm_weight"])(g)
    g.outputs.append("missing")
    with pytest.raises(VerificationError) as e:
        verify_graph(g)
    assert len(e.value.problems) == 3
    text = str(e.value)
    assert "3 problem(s)" in text and "node act (swish)" in text and "node norm (rms_norm)" in text and "'missing'" in text


def test_later_nodes_still_checked_after_a_bad_one() -> None:
    g = parse_graph("""
    def forward(x: float32[num_tokens, 4]):
        y = relu(x)
        z = exp(y)
        return z
    """)
    g.nodes[0] = g.nodes[0].clone(op="nope")
    g.nodes[1] = g.nodes[1].clone(outputs=[Value("z", TensorType("float32", ("num_tokens", 5)))])
    with pytest.raises(VerificationError) as e:
        verify_graph(g)
    assert len(e.value.problems) == 2 and "node z (exp): output types" in e.value.problems[1]


def test_optional_inputs_and_partial_attrs_are_fine() -> None:
    g = Graph(inputs=[Value("x", TensorType("float32", (3, 4)))])
    g.nodes.append(Node("y", "rms_norm", ["x", None], [Value("y", TensorType("float32", (3, 4)))], {}))
    g.outputs = ["y"]
    verify_graph(g)
