"""Small graphs built with GraphBuilder for the printer/serialize/verify/notebook tests.

They do not depend on capture: a one-layer decoder with the op mix a captured Llama or
Qwen3 has (tied embedding, rms_norm, rope, GQA attention, gated MLP).
"""

from __future__ import annotations

import math

import torch

from portlayer.flatten.ir import Graph, GraphBuilder, TensorType

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, FFN, MAX_POS = 16, 4, 2, 4, 32, 24, 64


def rope_cache(max_pos: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv = [1.0 / base ** (2 * i / rotary_dim) for i in range(rotary_dim // 2)]
    return torch.tensor([[math.cos(p * f) for f in inv] + [math.sin(p * f) for f in inv] for p in range(max_pos)])


def tiny_decoder(seed: int = 0, *, tied: bool = True) -> Graph:
    """A one-layer Llama-like decoder over the flat token stream, with random weights."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    b = GraphBuilder()
    ids = b.add_input("input_ids", TensorType("int64", ("num_tokens",)))
    pos = b.add_input("positions", TensorType("int64", ("num_tokens",)))
    emb_w = w(VOCAB, HIDDEN)
    embed = b.add_param("model_embed_tokens_weight", emb_w)
    cache = b.add_param("rope_cos_sin_cache", rope_cache(MAX_POS, HEAD_DIM))
    h = b.add1("embedding", [embed, ids], name="embed_tokens", meta={"source": "model.embed_tokens"})
    p = "model_layers_0_"
    x = b.add1("rms_norm", [h, b.add_param(p + "input_layernorm_weight", 1 + w(HIDDEN))], {"eps": 1e-5},
               name="input_layernorm", meta={"source": "model.layers.0.input_layernorm"})
    q = b.add1("linear", [x, b.add_param(p + "self_attn_q_proj_weight", w(HEADS * HEAD_DIM, HIDDEN)), None], name="q_proj")
    k = b.add1("linear", [x, b.add_param(p + "self_attn_k_proj_weight", w(KV_HEADS * HEAD_DIM, HIDDEN))], name="k_proj")
    v = b.add1("linear", [x, b.add_param(p + "self_attn_v_proj_weight", w(KV_HEADS * HEAD_DIM, HIDDEN))], name="v_proj")
    q = b.add1("reshape", [q], {"shape": ["num_tokens", HEADS, HEAD_DIM]}, name="q_heads")
    k = b.add1("reshape", [k], {"shape": [-1, KV_HEADS, HEAD_DIM]}, name="k_heads")
    v = b.add1("reshape", [v], {"shape": ["num_tokens", KV_HEADS, HEAD_DIM]}, name="v_heads")
    rope_attrs = {"rotary_dim": HEAD_DIM, "head_dim": HEAD_DIM}
    q = b.add1("rope", [q, pos, cache], rope_attrs, name="q_rot")
    k = b.add1("rope", [k, pos, cache], rope_attrs, name="k_rot")
    a = b.add1("attention", [q, k, v], {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                        "scale": HEAD_DIM**-0.5, "layer": 0},
               name="attn", meta={"source": "model.layers.0.self_attn", "impl": "reference"})
    a = b.add1("reshape", [a], {"shape": ["num_tokens", HEADS * HEAD_DIM]}, name="attn_flat")
    o = b.add1("linear", [a, b.add_param(p + "self_attn_o_proj_weight", w(HIDDEN, HEADS * HEAD_DIM))], name="o_proj")
    h = b.add1("add", [h, o], name="resid_attn")
    x = b.add1("rms_norm", [h, b.add_param(p + "post_attention_layernorm_weight", 1 + w(HIDDEN))], {"eps": 1e-5},
               name="post_attention_layernorm")
    gate = b.add1("linear", [x, b.add_param(p + "mlp_gate_proj_weight", w(FFN, HIDDEN))], name="gate_proj")
    up = b.add1("linear", [x, b.add_param(p + "mlp_up_proj_weight", w(FFN, HIDDEN))], name="up_proj")
    act = b.add1("mul", [b.add1("silu", [gate], name="act"), up], name="gated")
    down = b.add1("linear", [act, b.add_param(p + "mlp_down_proj_weight", w(HIDDEN, FFN))], name="down_proj")
    h = b.add1("add", [h, down], name="resid_mlp")
    h = b.add1("rms_norm", [h, b.add_param("model_norm_weight", 1 + w(HIDDEN))], {"eps": 1e-5}, name="norm")
    lm = b.add_param("lm_head_weight", emb_w if tied else w(VOCAB, HIDDEN))
    logits = b.add1("linear", [h, lm], name="logits")
    b.graph.outputs = [logits]
    b.graph.meta = {"architecture": "TinyDecoder", "num_layers": 1, "tie_word_embeddings": tied}
    return b.graph
