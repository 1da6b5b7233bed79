"""On a GPU: compile the extra HF architectures of tests/test_capture_archs.py for the local
descriptor (Triton), validate each artifact, and compare greedy generation with HF on the same
GPU (float32 compute so greedy tokens are comparable). Prints one line per architecture and
writes JSON to $OUT/gpu_archs.json.

    python scripts/gpu_archs.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]
from _bootstrap import bootstrap  # noqa: E402

bootstrap()
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from test_capture_archs import ARCHS, COMMON  # noqa: E402

import portlayer  # noqa: E402
from portlayer.runtime.engine import LLMEngine  # noqa: E402
from portlayer.runtime.sequence import SamplingParams  # noqa: E402


def main() -> int:
    out_dir = Path(os.environ.get("OUT", "."))
    results = {}
    tmp = Path(tempfile.mkdtemp())
    for name in sorted(ARCHS):
        cfg_cls, model_cls, kw = ARCHS[name]
        torch.manual_seed(0)
        model = model_cls(cfg_cls(**{**COMMON, **kw})).eval()
        r: dict = {}
        try:
            art = tmp / name
            portlayer.compile(model, target="auto", output=art, dtype="float32", progress=False)
            loaded = portlayer.load(art)
            rep = loaded.validate()
            r["target"], r["validate"] = loaded.descriptor.name, bool(rep.ok)
            if not name.startswith("roberta"):
                engine = LLMEngine.from_artifact(art)
                gen = torch.Generator().manual_seed(1)
                prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 17, 33)]
                outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
                model.set_attn_implementation("eager")
                model = model.to("cuda")
                agree = []
                for p, o in zip(prompts, outs):
                    ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=12, min_new_tokens=12,
                                         do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                    agree.append(ref == o.token_ids)
                r["greedy_equal_hf"] = agree
                r["program"] = type(engine.executable).__name__
        except Exception as e:  # report and go on to the next architecture
            r["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        results[name] = r
        print(name, json.dumps(r), flush=True)
    (out_dir / "gpu_archs.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
