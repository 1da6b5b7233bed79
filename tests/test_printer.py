"""The IR text format: exact expected printouts, print -> parse -> print round trips, and
parse errors that name the line."""

from __future__ import annotations

import pytest
import torch
from ir_samples import tiny_decoder

from portlayer.flatten import ops
from portlayer.flatten.ir import Graph, GraphBuilder, Node, TensorType, Value
from portlayer.flatten.ops import OpDef
from portlayer.flatten.printer import (
    ParseError,
    canonical_text,
    format_literal,
    parse_graph,
    parse_literal,
    parse_type,
    print_graph,
)


def small() -> Graph:
    b = GraphBuilder()
    x = b.add_input("x", TensorType("float32", ("num_tokens", 8)))
    w = b.add_param("norm_weight", torch.ones(8))
    n = b.add1("rms_norm", [x, w], {"eps": 1e-5}, name="norm", meta={"impl": "fused", "group": 2})
    c = b.add1("concat", [n, x], {"dim": 0}, name="both")
    b.graph.outputs = [b.add1("gelu", [c], {"approximate": "tanh"}, name="act")]
    return b.graph


SMALL_TEXT = """\
def forward(x: float32[num_tokens, 8]):
    # params:
    #   norm_weight: float32[8]
    norm = rms_norm(x, norm_weight, eps=1e-05)  # float32[num_tokens, 8]
    both = concat(norm, x)  # float32[2*num_tokens, 8]
    act = gelu(both, approximate='tanh')  # float32[2*num_tokens, 8]
    return act
"""


def test_exact_printout() -> None:
    assert print_graph(small()) == SMALL_TEXT


def test_show_meta_adds_trailing_meta() -> None:
    g = small()
    g.meta = {"architecture": "Small"}
    text = print_graph(g, show_meta=True)
    assert text.splitlines()[0] == "# meta: {'architecture': 'Small'}"
    assert "norm = rms_norm(x, norm_weight, eps=1e-05)  # float32[num_tokens, 8]  meta={'impl': 'fused', 'group': 2}" in text
    assert str(g) == print_graph(g)


@pytest.mark.parametrize("show_meta", [False, True])
def test_round_trip_tiny_decoder(show_meta: bool) -> None:
    g = tiny_decoder()
    text = print_graph(g, show_meta=show_meta)
    back = parse_graph(text)
    assert print_graph(back, show_meta=show_meta) == text
    assert back.params == g.params and back.weights == {}
    assert [v.name for v in back.inputs] == ["input_ids", "positions"]
    if show_meta:
        assert back.meta == g.meta
        assert back.node("attn").meta == {"source": "model.layers.0.self_attn", "impl": "reference"}


def test_parse_fills_default_attrs_and_types() -> None:
    g = parse_graph(SMALL_TEXT)
    norm = g.node("norm")
    assert norm.attrs == {"eps": 1e-5, "weight_offset": 0.0}
    assert norm.output.type == TensorType("float32", ("num_tokens", 8))
    assert g.node("both").output.type.shape == ("2*num_tokens", 8)
    assert g.outputs == ["act"]


def test_hand_written_text_without_type_comments() -> None:
    text = """
    def forward(x: float32[num_tokens, 8]):
        # a comment line is ignored
        y = mul(x, None, scalar=2)
        z = sum(y, dims=[-1])
        return z, y
    """
    g = parse_graph(text)
    assert g.node("y").output.type == TensorType("float32", ("num_tokens", 8))
    assert g.node("z").output.type == TensorType("float32", ("num_tokens",))
    assert g.node("y").attrs["scalar"] == 2 and isinstance(g.node("y").attrs["scalar"], int)
    assert g.outputs == ["z", "y"]
    assert "z = sum(y, dims=[-1])  # float32[num_tokens]" in print_graph(g)


def test_attr_literals_round_trip() -> None:
    b = GraphBuilder()
    x = b.add_input("x", TensorType("float32", (4,)))
    f = b.add1("full", [], {"shape": [2, "num_tokens"], "value": float("-inf")}, name="f")
    n = b.add1("full", [], {"shape": [1], "value": float("nan")}, name="n")
    m = b.add1("mul", [x, None], {"scalar": 1}, name="m")  # int 1, not the float default
    s = b.add1("slice", [x], {"dim": 0, "start": 1, "end": 3}, name="s")
    b.graph.outputs = [f, n, m, s]
    b.graph.meta = {"note": "a # inside a string", "t": (1, 2)}
    text = print_graph(b.graph, show_meta=True)
    assert "value=float('-inf')" in text and "value=float('nan')" in text and "scalar=1)" in text
    back = parse_graph(text)
    assert print_graph(back, show_meta=True) == text
    assert back.meta["note"] == "a # inside a string"
    assert back.node("f").attrs["value"] == float("-inf")


def test_long_header_wraps_and_round_trips() -> None:
    b = GraphBuilder()
    names = [b.add_input(f"metadata_input_{i}", TensorType("int32", ("num_tokens", 3))) for i in range(6)]
    b.graph.outputs = [b.add1("concat", names, {"dim": 1})]
    text = print_graph(b.graph)
    assert text.startswith("def forward(\n    metadata_input_0: int32[num_tokens, 3],\n")
    assert print_graph(parse_graph(text)) == text


def test_node_name_that_differs_from_its_output() -> None:
    g = small()
    g.nodes[0] = g.nodes[0].clone(name="layer0_norm")
    text = print_graph(g)
    assert "norm = rms_norm(x, norm_weight, eps=1e-05)  # float32[num_tokens, 8]  node=layer0_norm" in text
    back = parse_graph(text)
    assert back.nodes[0].name == "layer0_norm" and back.nodes[0].output.name == "norm"
    assert print_graph(back) == text


def test_multi_and_zero_output_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    def split_infer(ins, attrs):
        t = ins[0]
        return [t.with_shape((t.shape[0], attrs["at"])), t.with_shape((t.shape[0], t.shape[1] - attrs["at"]))]

    monkeypatch.setitem(ops._REGISTRY, "split2", OpDef("split2", "view", ("x",), {"at": 1}, split_infer, lambda x, at: None))
    monkeypatch.setitem(ops._REGISTRY, "sink", OpDef("sink", "data", ("x",), {}, lambda ins, a: [], lambda x: None))
    b = GraphBuilder()
    x = b.add_input("x", TensorType("float32", ("num_tokens", 8)))
    lo, hi = b.add("split2", [x], {"at": 3}, name="parts")
    b.add("sink", [hi], name="store")
    b.graph.outputs = [lo]
    text = print_graph(b.graph)
    assert "parts, parts_1 = split2(x, at=3)  # float32[num_tokens, 3], float32[num_tokens, 5]" in text
    assert "    sink(parts_1)  # node=store" in text
    back = parse_graph(text)
    assert print_graph(back) == text
    assert [v.name for v in back.node("parts").outputs] == ["parts", "parts_1"]
    assert back.node("store").outputs == []


def test_parse_type_and_literals() -> None:
    assert parse_type("float32[]") == TensorType("float32", ())
    assert parse_type("int64[Max(2, num_tokens), 2*num_tokens, 3]").shape == ("Max(2, num_tokens)", "2*num_tokens", 3)
    for v in [1e-06, -0.0, 3, True, None, "a'b", [1, "n", [2.5]], {"k": float("inf")}]:
        assert parse_literal(format_literal(v)) == v
    assert format_literal((1, 2)) == "[1, 2]"


BAD = [
    ("def forward(x: float32[4]):\n    y = relu(x)  # float32[5]\n    return y\n", 2, "infers float32[4]"),
    ("def forward(x: float32[4]):\n    y = relu(z)\n    return y\n", 2, "'z' of relu is not defined"),
    ("def forward(x: float32[4]):\n    y = frobnicate(x)\n    return y\n", 2, "not in the portable op registry"),
    ("def forward(x: float32[4]):\n    x = relu(x)\n    return x\n", 2, "defined twice"),
    ("def forward(x: float32[4]):\n    y = relu(x, bogus=1)\n    return y\n", 2, "unknown attributes"),
    ("def forward(x: float32[4]):\n    y = relu(x)\n", 3, "no 'return'"),
    ("def forward(x: float32[4]):\n    y = relu(x)\n    return q\n", 3, "'q' is not defined"),
    ("def forward(x: float32[4]):\n    y = mul(x, None, scalar=len(x))\n    return y\n", 2, "must be a Python literal"),
    ("def forward(x: float32[4], w: float32[3, 5]):\n    y = linear(x, w)\n    return y\n", 2, "linear"),
    ("def forward(x: float32[4]):\n    y = relu(x)  # looks fine\n    return y\n", 2, "output types"),
    ("y = relu(x)\n", 1, "def forward"),
    ("def forward(x: float32[4):\n    return x\n", 1, "is not a type like"),
    ("def forward(x: flaot32[4]):\n    return x\n", 1, "unknown dtype 'flaot32'"),
]


@pytest.mark.parametrize("text,line,msg", BAD, ids=[m for _, _, m in BAD])
def test_parse_errors_name_the_line(text: str, line: int, msg: str) -> None:
    with pytest.raises(ParseError) as e:
        parse_graph(text)
    assert f"line {line}:" in str(e.value) and msg in str(e.value)


def test_printed_node_matches_node_fields() -> None:
    n = Node("h", "add", ["a", "b"], [Value("h", TensorType("float16", (2,)))], {"scalar": None, "reverse": False})
    from portlayer.flatten.printer import format_node

    assert format_node(n) == "h = add(a, b)  # float16[2]"


def test_canonical_text_for_pass_tests() -> None:
    before = """
    def forward(x: float32[num_tokens, 4]):
        y = mul(x, None, scalar=1.0)
        z = relu(y)
        return z
    """
    after = """
    def forward(x: float32[num_tokens, 4]):
            z = relu(x)   # float32[num_tokens, 4]
            return z
    """
    g = parse_graph(before)  # a hand-rolled "drop multiply by one" rewrite
    g.nodes = [g.nodes[1].clone(inputs=["x"])]
    assert print_graph(g) == canonical_text(after)
    assert canonical_text(after) == "def forward(x: float32[num_tokens, 4]):\n    z = relu(x)  # float32[num_tokens, 4]\n    return z\n"
