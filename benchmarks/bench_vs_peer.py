"""portlayer against the torch.compile yardstick, in one device call (issue 12's table).

Runs, each in its own process so one's KV budget does not starve the next:
1. bench_serving.py on the Qwen3-0.6B shape compiled for the device (bf16): first request after
   load, prefill (16 prompts x 1,024 tokens), the 256-sequence serving workload, decode at batch 1
   and 64 (512-token context);
2. the same compiled with ``--quantize int4``: decode at batch 1;
3. the yardstick (``--peer``: the gpt-fast-style torch.compile Qwen3 of ../shared/bench/, copied
   next to the checkout) at batch 1 and 64.
Prints a table and writes the JSON (default docs/gpu-results/vs_peer_h200.json) with the figures,
the GPU and the commit. The numbers are benchmark figures, never test assertions.

    python benchmarks/bench_vs_peer.py --peer .devcarry/torch_compile_peer.py

All stages took ~12 minutes on an H200 with the int4 compile calibrating on the host's CPU (~165 s; the yardstick
compiles ~60 s per batch size); it now calibrates on the GPU (``--calibration-device``, default cuda: the 28-layer
int4 compile took 25 s in session 15), so about 10 (not timed whole), still more than a safe 10-minute device call: split them, ``--skip-peer`` in one call and
``--skip-int4`` with the peer in another. The JSON is rewritten
after every stage, so a call cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    t0 = time.perf_counter()
    print(f"[vs-peer] {' '.join(cmd)}", file=sys.stderr, flush=True)
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = 124, (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    print(f"[vs-peer]   rc={rc} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if rc:
        print(err[-3000:], file=sys.stderr)
    return rc, err


def _serving_bench(tmp: Path, name: str, extra: list[str], timeout: float) -> dict[str, Any]:
    out = tmp / f"{name}.json"
    rc, _ = _run([sys.executable, str(HERE / "bench_serving.py"), "--compile-target", "nvidia-h200", "--json", str(out),
                  "--artifact-out", str(tmp / f"{name}-artifact"), *extra], timeout)  # fmt: skip
    return json.loads(out.read_text()) if out.exists() else {"error": f"rc={rc}"}


VALIDATE = ("import sys; sys.path.insert(0, {here!r}); from _bootstrap import bootstrap; bootstrap(); "
            "from portlayer.cli import main; sys.exit(main(['validate', {art!r}]))")


def _validate(tmp: Path, name: str) -> dict[str, Any]:
    """``portlayer validate`` of the benchmarked artifact on this device (its outputs vs the reference)."""
    art = tmp / f"{name}-artifact"
    if not art.exists():
        return {"passed": False, "why": "no artifact"}
    rc, err = _run([sys.executable, "-c", VALIDATE.format(here=str(HERE), art=str(art))], 300)
    return {"passed": rc == 0, "tail": err.strip().splitlines()[-3:]}


def _decode(res: dict[str, Any], batch: int) -> float | None:
    return next((d["decode_tok_s"] for d in res.get("decode", []) if d["batch"] == batch), None)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def _summary(runs: dict[str, Any], commit: str) -> dict[str, Any]:
    bf16, int4, peer = runs["bf16"], runs["int4"], runs["peer"]
    serving = bf16.get("serving", {})
    return {
        "gpu": bf16.get("gpu"), "commit": commit, "date": time.strftime("%Y-%m-%d"),
        "model": "Qwen3-0.6B shape, random weights, bf16 compute, greedy",
        "decode_b1_tok_s": _decode(bf16, 1), "decode_b64_tok_s": _decode(bf16, 64),
        "serving_out_tok_s": serving.get("output_tok_s"), "serving_complete": serving.get("complete"),
        "first_request_ms": bf16.get("first_request", {}).get("first_request_ms"),
        "prefill_tok_s": bf16.get("prefill", {}).get("prefill_tok_s"),
        "int4_decode_b1_tok_s": _decode(int4, 1) if int4 else None,
        "peer_b1_tok_s": (peer.get("compiled_b1") or {}).get("decode_tok_s"),
        "peer_b64_tok_s": (peer.get("compiled_b64") or {}).get("decode_tok_s"),
        "peer_versions": peer.get("versions"), "validate": runs["checks"],
        "runs": {"bf16": bf16, "int4": int4, "peer": {k: v for k, v in peer.items() if k.startswith("compiled_")}},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", required=True, help="path of torch_compile_peer.py (the yardstick)")
    p.add_argument("--json", default=str(ROOT / "docs" / "gpu-results" / "vs_peer_h200.json"))
    p.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    p.add_argument("--serving-time-limit", type=float, default=120.0)
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--skip-int4", action="store_true")
    p.add_argument("--calibration-device", default="cuda",
                   help="where the int4 compile calibrates and runs its quality gate (bench_serving.py's flag)")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="vs-peer-"))
    runs: dict[str, Any] = {"bf16": {}, "int4": {}, "peer": {}, "checks": {}}

    def save() -> dict[str, Any]:  # after every stage: a call cut short still leaves what it measured
        res = _summary(runs, args.commit or _commit())
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
        return res

    runs["bf16"] = _serving_bench(tmp, "bf16", ["--first-request", "--prefill", "16x1024", "--decode-batches", "1,64",
                                                "--time-limit", str(args.serving_time_limit)], 420)  # fmt: skip
    save()
    if not args.skip_int4:
        runs["int4"] = _serving_bench(tmp, "int4", ["--quantize", "int4", "--calibration-device", args.calibration_device,
                                                    "--decode-batches", "1", "--skip-serving"], 300)  # fmt: skip
        save()
    runs["checks"] = {"bf16": _validate(tmp, "bf16"), **({} if args.skip_int4 else {"int4": _validate(tmp, "int4")})}
    save()
    if not args.skip_peer:
        env = {**os.environ, "OUT": str(tmp)}
        _run([sys.executable, args.peer, "--batches", "1,64", "--no-eager", "--no-extras"], 330, env)
        f = tmp / "gpu_compiled_peer.json"
        runs["peer"] = json.loads(f.read_text()) if f.exists() else {}
    res = save()
    rows = [("decode batch 1 (tok/s)", res["decode_b1_tok_s"], res["peer_b1_tok_s"]),
            ("decode batch 64 (tok/s)", res["decode_b64_tok_s"], res["peer_b64_tok_s"]),
            ("serving 256 seqs (out tok/s)", res["serving_out_tok_s"], None),
            ("first request after load (ms)", res["first_request_ms"], None),
            ("prefill 16 x 1024 (tok/s)", res["prefill_tok_s"], None),
            ("int4 decode batch 1 (tok/s)", res["int4_decode_b1_tok_s"], None)]
    print("| figure | portlayer | torch.compile | ratio |\n|---|---|---|---|")
    for name, ours, theirs in rows:
        ratio = f"{ours / theirs:.2f}" if ours and theirs else ""
        print(f"| {name} | {ours if ours is not None else '-'} | {theirs if theirs is not None else '-'} | {ratio} |")
    print(f"[vs-peer] wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
