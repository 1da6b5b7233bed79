"""What a model asks of a device: the numbers the policy negotiates against a descriptor.

Kept apart from the Graph so the policy can be tested (and `portlayer explain` can run
from a config.json) without capturing a model; ``from_graph`` is the exact path.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from portlayer.flatten.ir import Graph

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "int4": 0.5, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class ModelRequirements:
    """Sizes in bytes are at the captured ``dtype``; use the ``*_at`` helpers for another."""

    name: str
    task: str
    dtype: str
    param_count: int
    param_bytes: int
    flops_per_token: int
    bytes_per_token: int
    gemm_shapes: tuple[tuple[int, int], ...]
    head_dims: tuple[int, ...]
    num_layers: int
    num_heads: int
    num_kv_heads: int
    kv_bytes_per_token_per_layer: int
    max_positions: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    sliding_window: int | None = None

    @property
    def itemsize(self) -> float:
        return ITEMSIZE[self.dtype]

    def param_bytes_at(self, dtype: str) -> int:
        return int(self.param_count * ITEMSIZE[dtype])

    def kv_bytes_per_token_at(self, dtype: str) -> int:
        """KV-cache bytes one token needs across all layers, stored in ``dtype``."""
        per_layer = self.kv_bytes_per_token_per_layer / self.itemsize * ITEMSIZE[dtype]
        return int(per_layer * self.num_layers)

    @property
    def needs_kv_cache(self) -> bool:
        return self.task == "causal_lm" and self.kv_bytes_per_token_per_layer > 0

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["gemm_shapes"] = [list(s) for s in self.gemm_shapes]
        d["head_dims"] = list(self.head_dims)
        return d

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> ModelRequirements:
        d = dict(d)
        d["gemm_shapes"] = tuple(tuple(s) for s in d["gemm_shapes"])
        d["head_dims"] = tuple(d["head_dims"])
        return ModelRequirements(**d)

    # ---- constructors --------------------------------------------------------------
    @staticmethod
    def from_graph(graph: Graph, name: str | None = None) -> ModelRequirements:
        """Read sizes from the graph's params and nodes, config facts from graph.meta."""
        meta = graph.meta
        float_params = [t for t in graph.params.values() if t.dtype in ("float32", "float16", "bfloat16")]
        dtype = meta.get("dtype") or (float_params[0].dtype if float_params else "float32")
        param_count = sum(t.numel() for t in graph.params.values())
        param_bytes = sum(t.nbytes() for t in graph.params.values())
        gemms: list[tuple[int, int]] = []
        linear_flops = 0
        for n in graph.find("linear"):
            w = graph.params.get(n.inputs[1]) if len(n.inputs) > 1 and n.inputs[1] else None
            if w is not None and w.rank == 2 and w.is_static:
                nk = (int(w.shape[0]), int(w.shape[1]))
                linear_flops += 2 * nk[0] * nk[1]
                if nk not in gemms:
                    gemms.append(nk)
        attn = graph.find("attention")
        head_dims = sorted({int(n.attrs["head_dim"]) for n in attn if n.attrs.get("head_dim")})
        if not head_dims and meta.get("head_dim"):
            head_dims = [int(meta["head_dim"])]
        num_kv = int(attn[0].attrs.get("num_kv_heads") or 0) if attn else int(meta.get("num_kv_heads") or 0)
        num_heads = int(attn[0].attrs.get("num_heads") or 0) if attn else int(meta.get("num_heads") or 0)
        windows = [n.attrs.get("sliding_window") for n in attn if n.attrs.get("sliding_window")]
        task = meta.get("task", "causal_lm")
        kv = 2 * num_kv * (head_dims[-1] if head_dims else 0) * ITEMSIZE[dtype] if task == "causal_lm" else 0
        mla = graph.find("mla_attention")
        if mla and task == "causal_lm":  # MLA's latent cache: kv_lora_rank + rope per token, no values
            a = mla[0].attrs
            head_dims = [int(a["qk_nope_head_dim"]) + int(a["qk_rope_head_dim"])]
            num_kv, num_heads = 1, int(a["num_heads"])
            kv = (int(a["kv_lora_rank"]) + int(a["qk_rope_head_dim"])) * ITEMSIZE[dtype]
        flops, moved = linear_flops, param_bytes
        try:
            from portlayer.flatten.ops import graph_cost

            cost = graph_cost(graph, {"num_tokens": 1})
            flops, moved = cost.flops, cost.bytes
        except ImportError:
            pass
        except Exception as e:  # a graph the cost model cannot type: keep the linear-layer estimate
            warnings.warn(
                f"graph_cost failed ({type(e).__name__}: {e}); FLOPs/bytes per token estimated from linear layers",
                RuntimeWarning,
                stacklevel=2,
            )
        return ModelRequirements(
            name=name or str(meta.get("source") or meta.get("model_type") or "model"),
            task=task,
            dtype=dtype,
            param_count=param_count,
            param_bytes=param_bytes,
            flops_per_token=int(flops),
            bytes_per_token=int(moved),
            gemm_shapes=tuple(gemms),
            head_dims=tuple(head_dims),
            num_layers=int(meta.get("num_layers") or len(attn) or 1),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            kv_bytes_per_token_per_layer=int(kv),
            max_positions=int(meta.get("max_positions") or 4096),
            hidden_size=int(meta.get("hidden_size") or 0),
            intermediate_size=int(meta.get("intermediate_size") or 0),
            vocab_size=int(meta.get("vocab_size") or 0),
            sliding_window=max(windows) if windows else None,
        )

    @staticmethod
    def from_hf_config(cfg: Mapping[str, Any], name: str = "model", dtype: str | None = None) -> ModelRequirements:
        """Analytic requirements of a Llama/Qwen-style decoder from its config.json (no weights)."""
        h = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        d = int(cfg.get("head_dim") or h // heads)
        inter = int(cfg.get("intermediate_size") or 4 * h)
        vocab = int(cfg["vocab_size"])
        layers = int(cfg["num_hidden_layers"])
        dtype = dtype or {"bfloat16": "bfloat16", "float16": "float16"}.get(
            str(cfg.get("torch_dtype") or cfg.get("dtype")), "float32"
        )
        gemms = [(heads * d, h), (kv_heads * d, h), (h, heads * d), (inter, h), (h, inter), (vocab, h)]
        per_layer = heads * d * h + 2 * kv_heads * d * h + h * heads * d + 3 * inter * h + 2 * h
        params = layers * per_layer + vocab * h * (1 if cfg.get("tie_word_embeddings") else 2) + h
        flops = 2 * (layers * (per_layer - 2 * h) + vocab * h)
        archs = cfg.get("architectures") or []
        task = "causal_lm" if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) or not archs else "encoder"
        item = ITEMSIZE[dtype]
        return ModelRequirements(
            name=name,
            task=task,
            dtype=dtype,
            param_count=params,
            param_bytes=int(params * item),
            flops_per_token=flops,
            bytes_per_token=int(params * item),
            gemm_shapes=tuple(dict.fromkeys(gemms)),
            head_dims=(d,),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            kv_bytes_per_token_per_layer=int(2 * kv_heads * d * item) if task == "causal_lm" else 0,
            max_positions=int(cfg.get("max_position_embeddings") or 4096),
            hidden_size=h,
            intermediate_size=inter,
            vocab_size=vocab,
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window") else None,
        )

    @staticmethod
    def from_hf_config_file(path: str) -> ModelRequirements:
        with open(path) as f:
            return ModelRequirements.from_hf_config(json.load(f), name=str(path))
