"""ONNX in, on the H200: export MiniLM (TorchScript exporter) and a tiny Llama (dynamo exporter if
onnxscript is there) to ONNX, compile each for the GPU here (--target auto), validate on the device,
and compare the artifact's outputs with onnxruntime.

    python scripts/onnx_gpu_check.py        # from the repo root; results under $OUT (or ./onnx-gpu-results)

Prints one line per model: compile / validate / max abs error vs ORT. Needs onnx (and onnxruntime
for the ORT comparison); what is missing is reported, not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def main() -> int:
    out = Path(os.environ.get("OUT") or ROOT / "onnx-gpu-results")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PORTLAYER_CACHE", str(out / "cache"))
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    try:
        import onnx  # noqa: F401
    except ImportError:
        print("onnx is not installed on this host: nothing to check")
        return 1
    from onnx_samples import export_minilm, export_tiny_llama

    models = {}
    try:
        models["minilm"] = export_minilm(out / "minilm.onnx", dynamo=False)
    except Exception as e:  # report and go on
        print(f"minilm: export failed: {type(e).__name__}: {e}")
    try:
        models["tiny-llama"] = export_tiny_llama(out / "llama.onnx")
    except Exception as e:
        print(f"tiny-llama: export failed (the dynamo exporter needs onnxscript): {type(e).__name__}: {e}")
    fail = 0
    results = {}
    for name, path in models.items():
        art = out / f"art-{name}"
        cmd = [sys.executable, "-m", "portlayer.cli"]
        c = subprocess.run(cmd + ["compile", str(path), "--target", "auto", "-o", str(art), "--no-progress"],
                           capture_output=True, text=True, cwd=ROOT)
        v = subprocess.run(cmd + ["validate", str(art)], capture_output=True, text=True, cwd=ROOT) if c.returncode == 0 else None
        line = {"compile": c.returncode, "validate": v.returncode if v else None}
        if c.returncode != 0:
            line["compile_tail"] = c.stderr[-1500:] + c.stdout[-500:]
        if v is not None:
            line["validate_tail"] = v.stdout[-1500:] + v.stderr[-500:]
        line["vs_ort"] = _vs_ort(name, path, art) if c.returncode == 0 else None
        results[name] = line
        ok = c.returncode == 0 and v is not None and v.returncode == 0 and (line["vs_ort"] or {}).get("ok", False)
        fail |= not ok
        print(f"{name}: compile rc={c.returncode} validate rc={line['validate']} vs ORT: {line['vs_ort']}")
    (out / "onnx_gpu_check.json").write_text(json.dumps(results, indent=1))
    print("PASSED" if not fail else "FAILED", f"(details: {out / 'onnx_gpu_check.json'})")
    return int(bool(fail))


def _vs_ort(name: str, path: Path, art: Path) -> dict:
    """The compiled artifact (on the GPU) against onnxruntime (CPU) on one input."""
    try:
        import torch
        from onnx_samples import ort_run

        from portlayer.runtime.engine import LLMEngine
    except ImportError as e:
        return {"ok": False, "why": f"missing: {e}"}
    engine = LLMEngine.from_artifact(art)
    if name == "minilm":
        ids = [[101, 1037, 2158, 2003, 5983, 2833, 1012, 102], [101, 7632, 102]]
        emb = engine.embed(ids).float().cpu()
        refs = []
        for s in ids:
            t = torch.tensor([s])
            h = ort_run(path, {"input_ids": t, "attention_mask": torch.ones_like(t), "token_type_ids": torch.zeros_like(t)})
            refs.append(h[0].mean(0))
        cos = torch.nn.functional.cosine_similarity(emb, torch.stack(refs), dim=-1).min().item()
        return {"ok": cos >= 0.999, "min_cosine_vs_ort_mean_pooled": cos}
    from portlayer.runtime.sequence import SamplingParams

    ids = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(0))
    logits = ort_run(path, {"input_ids": ids[None]})[0]
    want = int(logits[-1].argmax())
    top2 = logits[-1].topk(2).values
    got = engine.generate([ids.tolist()], SamplingParams(temperature=0.0, max_tokens=1))[0].token_ids
    return {"ok": list(got) == [want], "ort_greedy_token": want, "engine_token": list(got),
            "ort_top2_margin": float(top2[0] - top2[1])}

if __name__ == "__main__":
    sys.exit(main())
