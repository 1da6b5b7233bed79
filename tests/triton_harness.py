"""Shared helpers of the Triton test tiers: build one-op graphs, run generated programs.

A kernel is tested the way it runs in production: its group is rendered, written into a
generated host program, loaded and run, then compared with the op's reference
implementation on the same fresh random inputs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

# Triton decides interpreted-or-compiled when triton.language is first imported (its own
# helpers such as tl.sum are @jit functions too), so the interpreter tier must be on before
# that. The AOT and GPU tiers therefore compile/run in subprocesses with it unset.
if "triton.language" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from portlayer.flatten.ir import Graph

FP32_TOL = 1e-4
HALF_TOL = 1e-2


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tol(dtype: str | torch.dtype) -> float:
    return FP32_TOL if str(dtype).replace("torch.", "") == "float32" else HALF_TOL


def float_dtype(graph: Graph) -> str:
    dts = [t.dtype for t in [*graph.params.values(), *(v.type for v in graph.inputs)]
           if t.dtype in ("float32", "float16", "bfloat16")]
    return dts[0] if dts else "float32"


def build_program(graph: Graph, tmp: Path, *, target: str = "nvidia-h200", launch=None,
                  triton_gemm_max_tokens: int | None = None, gemv_max_tokens: int | None = None, device: str = "cpu",
                  gemv_dot_max_tokens: int | None = None, kv_cache_dtype: str | None = None, **options: Any):
    """The pipeline's program for ``graph`` on ``target`` (passes -> lowerings -> host program), loaded.

    ``launch`` / ``triton_gemm_max_tokens`` / ``gemv_max_tokens`` / ``gemv_dot_max_tokens`` replace the Plan's
    launch configs and the descriptor's GEMM crossovers, so a test can reach a template path the shipped numbers do not choose at this size.
    ``kv_cache_dtype``: the Plan's KV cache element type instead of its pick (the program's ``kv_dtype``)."""
    from portlayer.backends.generate import generate
    from portlayer.codegen.program import load_program, write_program
    from portlayer.passes.pipeline import run_pipeline

    overrides = {"compute_dtype": float_dtype(graph), "weight_quantization": "none"}
    if kv_cache_dtype:
        overrides["kv_cache_dtype"] = kv_cache_dtype
    result = run_pipeline(graph, target, overrides=overrides)
    gen = generate(result.graph, result.plan, result.descriptor, launch=launch, gemm_max_tokens=triton_gemm_max_tokens,
                   gemv_max_tokens=gemv_max_tokens, gemv_dot_max_tokens=gemv_dot_max_tokens)
    assert gen.fallbacks == [], gen.fallbacks
    write_program(gen, tmp)
    options.setdefault("max_seqs", 8)
    prog = load_program(tmp, result.graph.weights, device, **options)
    prog.result = result  # the optimised graph, its kernel groups and plan, for assertions
    return gen, prog


def reference(graph: Graph, feeds: dict[str, torch.Tensor], meta=None, caches=None) -> list[torch.Tensor]:
    from portlayer.runtime.executable import ReferenceExecutable

    return ReferenceExecutable(graph).run(feeds, meta, caches)


def use_interpreter(monkeypatch) -> None:
    """Kernels imported while TRITON_INTERPRET=1 run on CPU; skip if Triton came up compiled."""
    import pytest
    import triton.language as tl

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if type(tl.sum).__name__ != "InterpretedFunction":
        pytest.skip("triton.language was imported before TRITON_INTERPRET=1 was set; run the interpreter "
                    "tier in its own process: pytest -m interpreter")


def paged_setup(num_seqs_ctx: list[tuple[int, int]], hkv: int, d: int, dtype: torch.dtype, block_size: int = 16,
                num_blocks: int = 32, seed: int = 0):
    """Metadata and random caches for sequences given as (cached tokens, new tokens).

    Blocks are handed out shuffled, so a kernel that ignores the block table fails.
    """
    from portlayer.flatten.op_defs.attention import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    starts, seq_lens, slots, tables = [0], [], [], []
    width = max(-(-(c + n) // block_size) for c, n in num_seqs_ctx)
    for cached, new in num_seqs_ctx:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(blocks + [0] * (width - len(blocks)))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, total)]
        starts.append(starts[-1] + new)
        seq_lens.append(total)
    prefills = sum(1 for _, n in num_seqs_ctx if n > 1)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=torch.tensor(tables, dtype=torch.int32),
        num_prefills=prefills, max_query_len=max(n for _, n in num_seqs_ctx), max_seq_len=max(seq_lens))
    return meta, k_cache, v_cache


def record_launches(monkeypatch: Any, launches: list[str]) -> None:
    """Every kernel a program loaded after this call launches is appended to ``launches`` by name
    (codegen/kernel_binaries.bind wrapped), then run as it would have been."""
    from portlayer.codegen import kernel_binaries as KB

    class Recorder:
        def __init__(self, name: str, fn: Any) -> None:
            self.name, self.fn = name, fn

        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> Any:
                launches.append(self.name)
                return self.fn[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(KB, "bind", lambda fns, sources, device: {n: Recorder(n, f) for n, f in fns.items()})


def h200_few_sms(root: Path, name: str = "nvidia-h200-4sm", **tuning: int) -> Path:
    """nvidia-h200's descriptor with 4 SMs, written under ``root``: the few-rows kernels then take 16 columns a
    program (launch.gemv PROGRAMS = 2 x SMs), so the interpreter runs 8x fewer programs with the same kernels.
    ``tuning``: fields set for the test (their sources say so)."""
    import json

    from portlayer import capabilities

    d = json.loads((Path(capabilities.__file__).parent / "devices" / "nvidia-h200.json").read_text())
    d["compute_units"]["count"] = 4
    d["tuning"].update(tuning)
    d["sources"].update({f"tuning.{k}": "test descriptor: set for the interpreter tests" for k in tuning})
    path = root / f"{name}.json"
    path.write_text(json.dumps(d))
    return path


def tiny_causal_lm(cfg_name: str, model_name: str, vocab: int, layers: int = 2, **kw: Any) -> Any:
    """A random-weight HF causal LM (transformers' ``cfg_name`` / ``model_name``, seed 0; untied and 512 positions
    unless ``kw`` says otherwise), its 1-D parameters (the norm weights) spread over [0.5, 1.5] so a skipped norm
    weight shows in the logits."""
    import transformers

    kw = {"vocab_size": vocab, "max_position_embeddings": 512, "tie_word_embeddings": False, **kw}
    cfg = getattr(transformers, cfg_name)(num_hidden_layers=layers, **kw)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg).eval()
    for p in model.parameters():
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    return model


def compiled_fp32(model: Any, root: Path, vocab: int, target: Path | str, name: str = "art") -> Path:
    """``model`` saved under ``root`` with a byte tokenizer of ``vocab`` ids, compiled for ``target`` in float32
    as kernel sources (the interpreter runs them; no capture self-check): the artifact's directory."""
    import portlayer
    from portlayer.flatten.tokenizer import write_byte_tokenizer

    src = root / "model"
    model.save_pretrained(str(src))
    write_byte_tokenizer(src, vocab_size=vocab)
    art = root / name
    portlayer.compile(str(src), target=str(target), dtype="float32", output=art, progress=False,
                      sources_only=True, verify=False)
    return art


def interpreted_decode_step(art: Path, prompts: list[list[int]], nxt: list[int], monkeypatch: Any
                            ) -> tuple[torch.Tensor, list[str]]:
    """Logits [len(prompts), vocab] of one decode step (token ``nxt[i]`` after prompt i, all prefilled in one step)
    of a float32 GPU artifact run under the Triton interpreter, and the kernels that decode step launched."""
    from portlayer.flatten.logits import feed_last_rows
    from portlayer.loaded import open_artifact
    from portlayer.runtime.validation import new_kv_cache, step_metadata

    launches: list[str] = []
    record_launches(monkeypatch, launches)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    loaded = open_artifact(art, interpret=True)
    exe, graph = loaded.executable(), loaded.graph
    names = [v.name for v in graph.inputs]
    longest = max(len(p) for p in prompts) + 1
    caches = new_kv_cache(graph, len(prompts), longest, 16, torch.float32, "cpu")
    lens = [len(p) for p in prompts]
    steps = [([t for p in prompts for t in p], lens, [0] * len(prompts), [i for n in lens for i in range(n)]),
             (nxt, [1] * len(prompts), lens, lens)]
    with torch.inference_mode():
        for ids, step_lens, ctx, pos in steps:
            md = step_metadata(step_lens, ctx, block_size=16, max_len=longest, device="cpu")
            feeds = {"input_ids": torch.tensor(ids), "positions": torch.tensor(pos)}
            feed_last_rows(feeds, names, md)
            launches.clear()
            logits = exe.run(feeds, md, caches)[0]
    return logits.float(), list(launches)
