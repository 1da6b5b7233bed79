"""Small IR texts and helpers the pass tests share."""

from __future__ import annotations

from typing import Any

from portlayer.capabilities.descriptor import load_descriptor
from portlayer.capabilities.policy import plan_for_graph
from portlayer.flatten.ir import Graph
from portlayer.passes.context import PassContext

LAYER = """
def forward(input_ids: int64[num_tokens], positions: int64[num_tokens]):
    # params:
    #   emb: float16[64, 64]
    #   ln: float16[64]
    #   wq: float16[64, 64]
    #   wk: float16[32, 64]
    #   wv: float16[32, 64]
    #   wo: float16[64, 64]
    #   ln2: float16[64]
    #   wg: float16[128, 64]
    #   wu: float16[128, 64]
    #   cache: float16[128, 32]
    h = embedding(emb, input_ids)
    x = rms_norm(h, ln)
    q = linear(x, wq, None)
    k = linear(x, wk, None)
    v = linear(x, wv, None)
    qh = reshape(q, shape=['num_tokens', 2, 32])
    kh = reshape(k, shape=['num_tokens', 1, 32])
    vh = reshape(v, shape=['num_tokens', 1, 32])
    qr = rope(qh, positions, cache, rotary_dim=32, head_dim=32)
    kr = rope(kh, positions, cache, rotary_dim=32, head_dim=32)
    a = attention(qr, kr, vh, num_heads=2, num_kv_heads=1, head_dim=32)
    a2 = reshape(a, shape=['num_tokens', 64])
    o = linear(a2, wo, None)
    r = add(h, o)
    y = rms_norm(r, ln2)
    gate = linear(y, wg, None)
    act = silu(gate)
    up = linear(y, wu, None)
    m = mul(act, up)
    return m
"""


def ctx_for(graph: Graph, target: str, **options: Any) -> PassContext:
    d = load_descriptor(target)
    return PassContext(d, plan_for_graph(graph, d), dict(options))


def keep_meta(graph: Graph, keys: tuple[str, ...]) -> Graph:
    """A copy whose node meta holds only ``keys`` and whose graph meta is empty (for IR-text asserts)."""
    g = graph.copy()
    g.meta = {}
    for n in g.nodes:
        n.meta = {k: n.meta[k] for k in keys if k in n.meta}
    return g
