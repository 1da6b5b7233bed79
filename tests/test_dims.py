"""Symbolic dims: the strict grammar (nothing in a shape string runs) and cheap canonical forms.

References are independent of flatten/dims.py: sympy.sympify on strings this file wrote
(trusted), and plain Python arithmetic on the same expressions.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import sympy
from ir_samples import tiny_decoder

from portlayer.flatten import dims
from portlayer.flatten.ir import TensorType, eval_dim, normalize_dim, to_sympy
from portlayer.flatten.parser import ParseError, parse_graph
from portlayer.flatten.serialize import GraphFileError, graph_to_json, load_graph, save_graph


def _payload(target) -> str:
    return f"Symbol.__new__.__globals__['__builtins__']['__import__']('os').system('touch {target}')"


def test_the_payload_is_a_real_exploit_under_sympify(tmp_path):
    """Control: the string the other tests feed in does run code through sympify (what we replaced)."""
    target = tmp_path / "control"
    try:
        sympy.sympify(_payload(target))
    except Exception:
        pass
    assert target.exists()


def test_payload_in_a_shape_is_refused_everywhere_and_never_runs(tmp_path):
    target = tmp_path / "pwn"
    bad = _payload(target)
    for fn in (normalize_dim, to_sympy, dims.parse_dim, dims.dim_names,
               lambda d: eval_dim(d, {"num_tokens": 1}), lambda d: TensorType("float32", (d, 4))):
        with pytest.raises(dims.DimError, match=r"not a symbolic size: unexpected '\.' at position 6"):
            fn(bad)
    assert not target.exists()


def test_payload_in_graph_json_names_value_and_file(tmp_path):
    target = tmp_path / "pwn"
    g = tiny_decoder()
    d = tmp_path / "saved"
    save_graph(g, d)
    doc = json.loads((d / "graph.json").read_text())
    doc["inputs"][0]["shape"][0] = _payload(target)
    (d / "graph.json").write_text(json.dumps(doc))
    with pytest.raises(GraphFileError) as e:
        load_graph(d)
    msg = str(e.value)
    assert str(d / "graph.json") in msg and "Symbol.__new__" in msg and "not a symbolic size" in msg
    assert not target.exists()


def test_payload_in_memory_plan_of_graph_json_is_refused_at_load(tmp_path):
    target = tmp_path / "pwn"
    doc = graph_to_json(tiny_decoder())
    doc["meta"]["memory_plan"] = {"buffers": {"x": {"size": _payload(target), "offset": 0}}}
    d = tmp_path / "saved"
    d.mkdir()
    (d / "graph.json").write_text(json.dumps(doc))
    with pytest.raises(GraphFileError, match=r"memory_plan buffer 'x' size: dimension .*Symbol"):
        load_graph(d)
    assert not target.exists()


def test_payload_in_ir_text_names_the_line(tmp_path):
    target = tmp_path / "pwn"
    text = f"def forward(x: float32[{_payload(target)}, 4]):\n    y = relu(x)\n    return y\n"
    with pytest.raises(ParseError, match=r"line 1: input x: dimension .*not a symbolic size"):
        parse_graph(text)
    assert not target.exists()


def test_payload_in_host_dim_is_refused(tmp_path):
    from portlayer.codegen.kernels.context import host_dim

    target = tmp_path / "pwn"
    with pytest.raises(dims.DimError):
        host_dim(_payload(target))
    assert not target.exists()
    assert host_dim("2*num_tokens + num_seqs") == "S + 2*T"


@pytest.mark.parametrize("bad, why", [
    ("", "empty"), ("num_tokens +", "ends early"), ("num_tokens)", "unexpected '\\)'"),
    ("(num_tokens", "expected '\\)'"), ("f(num_tokens)", "'f' at position 0 is not a function"), ("num_tokens.real", "unexpected '\\.'"),
    ("lambda", "cannot name a symbol"), ("__import__", "cannot name a symbol"), ("ceiling", "call it as"),
    ("Max(num_tokens)", "takes 2 to 64"), ("2**100", "exponent up to 16"), ("n**n", "integer exponent"),
    ("(((2**16)**16)**16)**2", "nest more than 3"), ("num_tokens/0", "not finite"), ("1.5*num_tokens", "unexpected '\\.'"),
    ("num_tokens; import os", "unexpected ';'"), ("'num_tokens'", "unexpected \"'\""), ("1/2", "not an integer"),
    ("9" * 41, "more than 40 digits"), ("num_tokens\n+1", None), ("\u0663*num_tokens", "unexpected"),
    ("num_tokens\u00b2", "unexpected"), ("num_tokens\u00a0+ 1", "unexpected .* at position 10"),
])  # fmt: skip
def test_grammar_refusals(bad, why):
    if why is None:  # whitespace, newlines included, is allowed between tokens
        assert normalize_dim(bad) == "num_tokens + 1"
        return
    with pytest.raises(dims.DimError, match=why):
        normalize_dim(bad)


def test_deep_and_long_strings_give_a_clear_error_not_recursion():
    for s in ("(" * 100_000 + "n" + ")" * 100_000, "-" * 100_000 + "n", "+".join(["n"] * 600),
              "-" * 900 + "n", "(" * 400 + "n" + ")" * 400, "Max(1, " * 200 + "n" + ")" * 200):
        with pytest.raises(dims.DimError, match="characters long|deeper than"):
            normalize_dim(s)
    assert normalize_dim("(" * 60 + "num_tokens" + ")" * 60) == "num_tokens"


# ---- canonical forms and evaluation against independent references -----------------------------
_PY = {"ceiling": math.ceil, "floor": math.floor, "Max": max, "Min": min, "Mod": lambda a, b: a % b}


def _reference_value(text: str, n: int, s: int) -> int:
    """Python's own arithmetic on the (test-written) expression, exact through Fraction."""
    from fractions import Fraction

    v = eval(text, {"__builtins__": {}, **_PY}, {"num_tokens": Fraction(n), "num_seqs": Fraction(s)})  # trusted text
    assert v == int(v)
    return int(v)


def _random_expr(rng: random.Random, depth: int = 0) -> str:
    if depth > 3 or rng.random() < 0.3:
        return rng.choice(["num_tokens", "num_seqs", str(rng.randint(1, 9))])
    a, b = _random_expr(rng, depth + 1), _random_expr(rng, depth + 1)
    return rng.choice([f"({a} + {b})", f"({a}*{b})", f"ceiling(({a})/{rng.randint(1, 8)})", f"({a})//{rng.randint(1, 8)}",
                       f"Max({a}, {b})", f"Min({a}, {b})", f"Mod({a}, {rng.randint(1, 8)})", f"floor(({a})/{rng.randint(1, 5)})",
                       f"({a} - {b} + {b})", f"({a})**2"])


def test_random_expressions_canonicalise_evaluate_and_round_trip():
    rng = random.Random(7)
    syms = {n: sympy.Symbol(n, integer=True, positive=True) for n in ("num_tokens", "num_seqs")}
    for _ in range(200):
        e = _random_expr(rng)
        c = normalize_dim(e)
        assert normalize_dim(str(c)) == c  # idempotent: the canonical spelling reads back to itself
        assert sympy.expand(sympy.sympify(e, locals=syms)) == to_sympy(c)  # built as sympify would, minus eval
        for n, s in ((1, 1), (3, 2), (17, 5), (512, 64)):
            want = _reference_value(e, n, s)
            assert eval_dim(e, {"num_tokens": n, "num_seqs": s}) == want
            assert eval_dim(c, {"num_tokens": n, "num_seqs": s}) == want, (e, c)


def test_torch_spellings_read_as_what_torch_means():
    """torch.utils._sympy's functions print under their own names; each reads as the same value."""
    from torch.utils._sympy.functions import (
        CeilToInt,
        FloorDiv,
        FloorToInt,
        IntTrueDiv,
        ModularIndexing,
        PythonMod,
    )

    s0 = sympy.Symbol("num_tokens", integer=True, positive=True)
    exprs = [FloorDiv(s0 + 3, 4), PythonMod(s0, 3), ModularIndexing(s0, 2, 4), CeilToInt(IntTrueDiv(s0, 3)),
             FloorToInt(IntTrueDiv(s0, 5)) + FloorDiv(s0, 2), sympy.Max(1, FloorDiv(s0, 8))]
    for e in exprs:
        text = str(e)
        c = normalize_dim(text)
        for n in (1, 2, 5, 7, 64, 1001):
            want = int(e.subs(s0, n))  # torch's own sympy functions evaluate the reference
            assert eval_dim(text, {"num_tokens": n}) == eval_dim(c, {"num_tokens": n}) == want, (text, c, n)


def test_equal_sizes_compare_equal_and_sizes_stay_exact():
    assert normalize_dim("(num_tokens)*(64)*2") == normalize_dim("128*num_tokens") == "128*num_tokens"
    assert normalize_dim("2*(num_tokens + 1)") == normalize_dim("2*num_tokens + 2")
    assert normalize_dim("256*ceiling((128*num_tokens)/256)") == "256*ceiling(num_tokens/2)"
    assert normalize_dim("(num_tokens//2)") == "floor(num_tokens/2)"  # torch.export's FloorDiv spelling
    assert normalize_dim("PythonMod(num_tokens, 4) + num_tokens % 4") == "2*(Mod(num_tokens, 4))"
    assert normalize_dim("Max(1, num_tokens)") == "num_tokens"  # sizes are positive integers
    assert normalize_dim("ceiling(num_tokens)") == "num_tokens"
    assert normalize_dim("num_tokens - num_tokens + 3") == 3
    big = 2**61 + 1  # exact integers, no float rounding on the way
    assert eval_dim("ceiling(num_tokens/3)", {"num_tokens": big}) == -(-big // 3)
    with pytest.raises(dims.DimError, match="not an integer"):
        eval_dim("num_tokens/2", {"num_tokens": 3})
    with pytest.raises(KeyError, match="needs values for symbols"):
        eval_dim("num_seqs + num_tokens", {"num_tokens": 3})


def test_captured_dims_match_the_old_simplify_spelling():
    """Every dim string that capture + passes produced for the tiny models and MiniLM (recorded
    on main before this change) has the same canonical spelling as sympy.simplify gave."""
    recorded = {
        "(num_tokens)*(64)*2": "128*num_tokens", "256*ceiling((128*num_tokens)/256)": "256*ceiling(num_tokens/2)",
        "256*ceiling((384*num_tokens)/256)": "256*ceiling(3*num_tokens/2)", "(num_tokens)*(12)*(32)*2": "768*num_tokens",
        "512*ceiling((768*num_seqs)/512)": "512*ceiling(3*num_seqs/2)", "64*ceiling((6144*num_tokens)/64)": "6144*num_tokens",
        "512*ceiling((64*num_tokens)/512)": "512*ceiling(num_tokens/8)", "num_seqs": "num_seqs", "16": 16,
    }  # fmt: skip
    syms = {n: sympy.Symbol(n, integer=True, positive=True) for n in ("num_tokens", "num_seqs")}
    for text, want in recorded.items():
        assert normalize_dim(text) == want
        assert sympy.simplify(sympy.sympify(text, locals=syms)) == sympy.sympify(str(want), locals=syms)


def test_memory_plan_stays_fast_at_depth():
    """Canonical forms are cached per string: 28 layers of identical sizes cost one layer's work."""
    import time

    texts = [f"(num_tokens)*({w})*{b}" for w in (64, 128, 192, 256, 384, 1536) for b in (2, 4)]
    dims.canonical_dim.cache_clear()
    t0 = time.perf_counter()
    for _ in range(28):
        for t in texts:
            normalize_dim(f"256*ceiling(({normalize_dim(t)})/256)")
    assert time.perf_counter() - t0 < 2.0


def test_payload_in_a_reshape_attribute_is_refused_when_run(tmp_path):
    """Attributes hold dims too (reshape targets); they are read by the same grammar when used."""
    import torch

    from portlayer.flatten.interpret import run_graph
    from portlayer.flatten.ir import Graph, GraphBuilder

    b = GraphBuilder(Graph())
    x = b.add_input("x", TensorType("float32", ("num_tokens", 8)))
    y = b.add1("reshape", [x], {"shape": ["num_tokens", 2, 4]})
    b.graph.outputs = [y]
    d = tmp_path / "saved"
    save_graph(b.graph, d)
    target = tmp_path / "pwn"
    doc = json.loads((d / "graph.json").read_text())
    doc["nodes"][0]["attrs"]["shape"][0] = _payload(target)
    (d / "graph.json").write_text(json.dumps(doc))
    g = load_graph(d)
    with pytest.raises(RuntimeError, match=r"node reshape \(reshape.*DimError: dimension .*not a symbolic size"):
        run_graph(g, {"x": torch.zeros(3, 8)})
    assert not target.exists()
