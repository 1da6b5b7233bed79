"""A float8_e4m3fn KV cache: asked for where the descriptor's kernels read it (the Plan keeps the compute dtype), it
holds twice the tokens, overrides are checked, the kernels' rounding is torch's, and on a real model (SmolLM2-135M) it
stays the same model as with a float32 cache. The attention kernels on such caches are checked against the reference op
in tests/test_triton_interp_attention.py."""

from __future__ import annotations

import pytest
import torch

from portlayer.capabilities.policy import PlanError, negotiate
from portlayer.capabilities.requirements import ModelRequirements


@pytest.fixture(scope="module")
def req(captured) -> ModelRequirements:
    return ModelRequirements.from_graph(captured["tiny-qwen3"])


def _kv_bytes_per_token(graph, itemsize: int) -> int:
    """From the captured attention ops' K/V shapes, not from the policy's own arithmetic."""
    types = graph.value_types()
    per_layer = [int(types[n.inputs[1]].shape[1]) * (int(types[n.inputs[1]].shape[2]) + int(types[n.inputs[2]].shape[2]))
                 for n in graph.find("attention")]
    return sum(per_layer) * itemsize


def test_an_asked_for_float8_cache_holds_twice_the_tokens(captured, req):
    """The H200's kernels read float8 caches (descriptor kv_cache.dtypes) but the Plan keeps the compute dtype (a
    float8 cache is lossy: asked for, never picked); asked for, the same budget holds twice the tokens."""
    bf16 = negotiate(req, "nvidia-h200", {"compute_dtype": "bfloat16"})
    fp8 = negotiate(req, "nvidia-h200", {"compute_dtype": "bfloat16", "kv_cache_dtype": "float8_e4m3fn"})
    assert bf16.kv_cache_dtype == "bfloat16" and "float8_e4m3fn" in bf16.decision("kv_cache_dtype").reason
    assert fp8.kv_cache_dtype == "float8_e4m3fn" and fp8.decision("kv_cache_dtype").reason.startswith("user override")
    g = captured["tiny-qwen3"]
    assert fp8.value("max_kv_tokens") == fp8.kv_cache_budget_bytes // _kv_bytes_per_token(g, 1)
    assert bf16.value("max_kv_tokens") == bf16.kv_cache_budget_bytes // _kv_bytes_per_token(g, 2)


@pytest.mark.parametrize("target,compute", [("cpu-x86_64", None), ("nvidia-h200", "float32"), ("amd-mi300x", None)])
def test_targets_without_a_float8_cache_keep_the_compute_dtype(req, target, compute):
    plan = negotiate(req, target, {"compute_dtype": compute} if compute else {})
    assert plan.kv_cache_dtype == plan.compute_dtype


def test_a_float8_cache_the_target_cannot_read_is_refused_by_name(req):
    with pytest.raises(PlanError, match="amd-mi300x descriptor's paged-attention kernels do not read float8_e4m3fn"):
        negotiate(req, "amd-mi300x", {"kv_cache_dtype": "float8_e4m3fn"})
    with pytest.raises(PlanError, match="not a KV cache dtype"):
        negotiate(req, "nvidia-h200", {"kv_cache_dtype": "int8"})
    # the torch family casts with torch: a CPU target may ask for it
    assert negotiate(req, "cpu-x86_64", {"kv_cache_dtype": "float8_e4m3fn"}).kv_cache_dtype == "float8_e4m3fn"


def _paged_logits(graph, ids: list[int], cache_dtype: torch.dtype, decode: int) -> torch.Tensor:
    """Logits of a paged prefill of ``ids`` then ``decode`` greedy steps, every K/V read back from a cache of
    ``cache_dtype`` (the reference op rounds to it as the kernels do): [len(ids) + decode, vocab]."""
    from portlayer.flatten.interpret import ExecContext, run_graph
    from portlayer.runtime.validation import new_kv_cache, step_metadata

    block, total = 16, len(ids) + decode
    caches = new_kv_cache(graph, 1, total, block, cache_dtype, "cpu")
    out, seq = [], list(ids)
    for start, n in [(0, len(ids))] + [(len(ids) + i, 1) for i in range(decode)]:
        md = step_metadata([n], [start], block_size=block, max_len=total, device="cpu")
        feeds = {"input_ids": torch.tensor(seq[start:start + n]), "positions": torch.arange(start, start + n)}
        feeds.update({v.name: torch.arange(n) for v in graph.inputs if v.name not in feeds})
        logits = run_graph(graph, feeds, ExecContext(attn_metadata=md, kv_cache=caches))[0].float()
        out.append(logits)
        seq.append(int(logits[-1].argmax()))
    return torch.cat(out)


def test_smollm2_with_a_float8_kv_cache_is_the_same_model(_isolated_cache):
    """Real weights: the chat model's next-token choices over a real prompt and 12 greedy steps, float8 cache
    against a float32 cache of the same graph (the independent reference: the model without KV rounding)."""
    from transformers import AutoTokenizer

    from portlayer.build import capture_cached
    from portlayer.builtin_models import resolve_model, smollm2_gguf
    from portlayer.runtime.cache import model_dir_hash

    d = resolve_model(str(smollm2_gguf()))
    graph = capture_cached(d, model_dir_hash(d), lambda _m: None)
    text = ("The capability descriptor says which primitives a device can compose and how fast; the compiler plans "
            "every kernel from it. On an accelerator with coarsely aligned buffers and its own fused operators, ")
    ids = AutoTokenizer.from_pretrained(d).encode(text)[:64]
    ref = _paged_logits(graph, ids, torch.float32, 12)
    got = _paged_logits(graph, ids, torch.float8_e4m3fn, 12)
    top1 = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    kl = float(torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                          reduction="none").sum(-1).mean())
    print(f"SmolLM2 float8 KV vs float32 KV: top-1 agreement {top1:.3f}, mean KL {kl:.4f} nats over {len(ref)} positions")
    assert top1 >= 0.95 and kl <= 0.02, (top1, kl)


def _e4m3_probe_values() -> torch.Tensor:
    """Every e4m3 value, the midpoints between neighbours (ties) and just off them, zeros, saturation, inf, NaN,
    small negatives that round to zero, and random values over many scales."""
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = every[torch.isfinite(every)].unique().sort().values
    mid = (finite[1:] + finite[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    rand = torch.cat([torch.randn(2048, generator=g) * s for s in (1e-3, 0.05, 1.0, 30.0, 300.0)])
    special = torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, -480.0, 1e9, float("inf"), float("-inf"), float("nan"),
                            -1e-5, -2.0**-10, 2.0**-10, 2.0**-9, -(2.0**-9)])
    vals = torch.cat([finite, mid, mid * (1 + 1e-6), mid * (1 - 1e-6), rand, special])
    return vals[: vals.numel() // 32 * 32]


def test_kernel_kv_write_rounds_to_float8_as_torch_does(tmp_path, monkeypatch):
    """The generated KV write (reshape_and_cache, float32 compute, float8 cache) stores the bytes torch's
    .to(torch.float8_e4m3fn) gives for every probe value: ties to even, subnormals, saturation, signed zeros."""
    from triton_harness import build_program, use_interpreter

    from portlayer.flatten.ir import GraphBuilder, TensorType
    from portlayer.runtime.validation import step_metadata

    use_interpreter(monkeypatch)
    b = GraphBuilder()
    q, k, v = (b.add_input(n, TensorType("float32", ("num_tokens", 2, 16))) for n in ("q", "k", "v"))
    b.graph.outputs = [b.add1("attention", [q, k, v], {"num_heads": 2, "num_kv_heads": 2, "head_dim": 16})]
    _, prog = build_program(b.graph, tmp_path, kv_cache_dtype="float8_e4m3fn")
    vals = _e4m3_probe_values()
    t = vals.numel() // 32
    kk = vals.view(t, 2, 16)
    vv = torch.flip(vals, [0]).reshape(t, 2, 16).contiguous()
    blocks = -(-t // 16)
    caches = [(torch.zeros(blocks, 16, 2, 16, dtype=torch.float8_e4m3fn),
               torch.zeros(blocks, 16, 2, 16, dtype=torch.float8_e4m3fn))]
    md = step_metadata([t], [0], block_size=16, max_len=t, device="cpu")
    prog.run({"q": torch.zeros(t, 2, 16), "k": kk, "v": vv}, md, caches)
    got_k = caches[0][0].view(torch.uint8).view(-1)[: t * 32]
    got_v = caches[0][1].view(torch.uint8).view(-1)[: t * 32]
    want_k = kk.reshape(-1).to(torch.float8_e4m3fn).view(torch.uint8)
    want_v = vv.reshape(-1).to(torch.float8_e4m3fn).view(torch.uint8)
    nan = torch.isnan(kk.reshape(-1))
    assert torch.equal(got_k[~nan], want_k[~nan]) and torch.equal(got_v[~torch.isnan(vv.reshape(-1))],
                                                                  want_v[~torch.isnan(vv.reshape(-1))])
    # NaN: the helper passes it to the store's cast, which is NaN on the GPU (cvt ... satfinite keeps NaN); Triton's
    # interpreter casts fp32 NaN to a finite e4m3 byte (as it mis-rounds carries), so it is not asserted here
    assert bool(nan.any())


def test_a_non_float8_cache_other_than_the_compute_dtype_is_refused(req):
    """The Triton kernels keep the cache in the compute dtype or a listed float8 type; a bf16 cache under float32
    compute would hand tl.dot mixed types, so it is refused with what to ask for instead."""
    with pytest.raises(PlanError, match="--kv-cache-dtype float16: the triton kernels keep the KV cache in the compute"):
        negotiate(req, "nvidia-h200", {"compute_dtype": "float32", "kv_cache_dtype": "float16"})
    assert negotiate(req, "cpu-x86_64", {"kv_cache_dtype": "bfloat16"}).kv_cache_dtype == "bfloat16"  # torch casts


def test_compile_records_an_asked_for_float8_cache_and_keys_it_apart(tmp_path):
    """`portlayer compile --kv-cache-dtype fp8` (the alias) reaches the Plan recorded in the artifact, and the compile
    cache keeps it apart from the same model's default compile."""
    import json

    import portlayer

    a = portlayer.compile("tiny-qwen3", target="cpu-x86_64", output=tmp_path / "fp8", kv_cache_dtype="fp8",
                          progress=False)
    b = portlayer.compile("tiny-qwen3", target="cpu-x86_64", output=tmp_path / "dflt", progress=False)
    plans = [json.loads((p.path / "plan.json").read_text()) for p in (a, b)]
    kv = [next(d["value"] for d in plan["decisions"] if d["name"] == "kv_cache_dtype") for plan in plans]
    assert kv == ["float8_e4m3fn", "float32"]
    with pytest.raises(Exception, match="--kv-cache-dtype 'int4' is not supported"):
        portlayer.compile("tiny-qwen3", target="cpu-x86_64", kv_cache_dtype="int4", progress=False)
