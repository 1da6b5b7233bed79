"""Compile and load a big Llama-shaped checkpoint: time, peak RSS and its ratio to the weights.

Builds (once, cached) a random-weight Llama-shaped HF checkpoint as sharded bf16 safetensors,
written shard by shard so the builder never holds the whole model; then, each in a fresh child
process so its peak RSS is its own, compiles it for each target and loads the artifact (for
targets this machine can run, also validates it against the artifact's reference outputs).

    python benchmarks/bench_scale.py --params 1.1B --targets cpu-x86_64,nvidia-h200
    python benchmarks/bench_scale.py --params 8B --targets nvidia-h200 --json docs/gpu-results/scale_8b_h200.json
    # in two processes (32B: each within a 9-minute call): compile and keep, then serve what was kept
    python benchmarks/bench_scale.py --params 32B --no-load --keep --drop-checkpoint --work W --json J
    python benchmarks/bench_scale.py --params 32B --serve-only --work W --json J --decode --validate

Peak RSS is the child's VmHWM (resident pages at their highest, file-backed mmap pages
included); ``rss_over_weights`` is peak RSS / checkpoint bytes, the figure issue 20 bounds
(<= 1.25x + 1 GB on the CPU host, + 2 GB on the H200 host).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bootstrap import REPO, bootstrap  # noqa: E402

#: Llama-shaped presets: (hidden, intermediate, layers, heads, kv heads, vocab)
SHAPES = {
    "tiny": (64, 128, 3, 4, 2, 256),
    "0.1B": (768, 2048, 8, 12, 4, 32000),
    "0.6B": (1024, 3072, 28, 16, 8, 151936),  # the Qwen3-0.6B sizes on a Llama graph
    "1.1B": (2048, 5632, 22, 32, 4, 32000),  # TinyLlama-1.1B
    "8B": (4096, 14336, 32, 32, 8, 128256),  # Llama-3-8B
    "32B": (5120, 27648, 64, 40, 8, 152064),  # Qwen2.5-32B sizes on a Llama graph
}
SHARD_BYTES = 1 << 30


def llama_config(params: str) -> dict:
    hidden, inter, layers, heads, kv, vocab = SHAPES[params]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hidden // heads, "vocab_size": vocab, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        "attention_bias": False, "mlp_bias": False,
    }  # fmt: skip


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, in HF's names, in the order a forward reads them."""
    h, i, v, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]  # fmt: skip
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def _random_tensor(shape: tuple[int, ...], seed: int) -> Any:
    """One checkpoint tensor from its own seed: the same bytes whatever thread or order makes it."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    if len(shape) == 1:
        return (1.0 + 0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    # std 1/sqrt(fan_in) keeps activations O(1) through the depth
    return (torch.randn(shape, generator=gen) * (shape[1] ** -0.5)).to(torch.bfloat16)


def build_checkpoint(params: str, root: Path, seed: int = 0, threads: int | None = None) -> Path:
    """Write (once) the checkpoint under ``root``: config.json, shards, the index. Returns the dir.

    Shards are made one at a time (the builder holds at most one shard, ~1 GiB), their tensors
    by a pool of threads (torch's RNG and casts release the GIL), each tensor from its own seed.
    """
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from safetensors.torch import save_file

    d = root / f"llama-{params}-bf16-seed{seed}-v2"
    if (d / "DONE").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    cfg = llama_config(params)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    shards: list[list[tuple[int, str, tuple[int, ...]]]] = [[]]
    size = 0
    for k, (name, shape) in enumerate(tensor_shapes(cfg)):
        nbytes = 2 * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((k, name, shape))
        size += nbytes
    weight_map, total = {}, 0
    workers = threads or min(16, os.cpu_count() or 1)
    intra = torch.get_num_threads()
    torch.set_num_threads(1)  # parallel over tensors, not inside each
    with ThreadPoolExecutor(workers) as pool:
        for j, shard in enumerate(shards):
            fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
            made = pool.map(lambda t: _random_tensor(t[2], seed * 100003 + t[0]), shard)
            tensors = {name: t for (_k, name, _s), t in zip(shard, made)}
            for name, t in tensors.items():
                weight_map[name] = fname
                total += t.numel() * 2
            save_file(tensors, str(d / fname), metadata={"format": "pt"})
            del tensors
    torch.set_num_threads(intra)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (d / "DONE").write_text(str(total))
    return d


def weight_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


# ---- the child: one measured step in a fresh process -----------------------------------------------
CHILD = r"""
import json, os, resource, sys, time
sys.path.insert(0, {bench!r})
from _bootstrap import bootstrap
bootstrap()
import torch, portlayer
def hwm():  # this process's own peak (VmHWM; ru_maxrss would carry the parent's peak across exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base = hwm()
what, model, target, art = sys.argv[1:5]
out = {{"base_rss": base}}
t0 = time.perf_counter()
if what == "compile":
    a = portlayer.compile(model, target=target, output=art, progress=False)
    out["timings"] = a.timings
else:
    m = portlayer.load(art, check_device=(what != "load-only"))
    out["verify_s"] = round(time.perf_counter() - t0, 3)
    if what == "load":
        ex = m.executable()
        out["load_s"] = round(time.perf_counter() - t0, 3)
        out["peak_rss_load"] = hwm()
        if {validate!r}:
            rep = m.validate(ex)
            out["validate"] = {{"ok": bool(rep.ok), "table": rep.format_table()}}
out["seconds"] = round(time.perf_counter() - t0, 3)
ru = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
out["cpu_s"] = round(sum(r.ru_utime + r.ru_stime for r in ru), 1)  # CPU time: steadier than wall on a shared host
out["load_avg"] = os.getloadavg()[0]
out["peak_rss"] = hwm()
print("BENCH_SCALE " + json.dumps(out))
"""


def run_child(what: str, model: Path, target: str, art: Path, env: dict[str, str], validate: bool,
              timeout: float) -> dict:
    code = CHILD.format(bench=str(Path(__file__).resolve().parent), validate=validate)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-c", code, what, str(model), target, str(art)]
    spy = os.environ.get("PORTLAYER_BENCH_PYSPY")  # a py-spy binary: sample the child into $OUT (profiling runs)
    if spy:
        prof = Path(os.environ.get("OUT", ".")) / f"pyspy_{what}_{target}.txt"
        cmd = [spy, "record", "-r", "10", "-f", "raw", "-o", str(prof), "--"] + cmd
    proc = subprocess.run(cmd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_SCALE ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"{what} exited {proc.returncode}", "stderr_tail": proc.stderr[-3000:], "wall_s": round(wall, 1)}
    res = json.loads(lines[-1].split(" ", 1)[1])
    res["wall_s"] = round(wall, 1)
    return res


def gib(n: float) -> float:
    return round(n / (1 << 30), 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", default="1.1B", choices=sorted(SHAPES))
    p.add_argument("--targets", default="cpu-x86_64,nvidia-h200")
    p.add_argument("--cache", default=os.environ.get("PORTLAYER_BENCH_CACHE", os.path.join(tempfile.gettempdir(), "portlayer-bench")),
                   help="where the checkpoint is built once and reused (e.g. /dev/shm when the disk cannot hold it)")
    p.add_argument("--work", default=None, help="where artifacts are written (default: a temp dir, removed)")
    p.add_argument("--no-load", action="store_true", help="compile only")
    p.add_argument("--validate", action="store_true", help="validate the loaded artifact on this machine")
    p.add_argument("--decode", action="store_true",
                   help="also time decode at batch 1 (benchmarks/bench_serving.py on the artifact; needs the device)")
    p.add_argument("--keep", action="store_true", help="keep the artifacts (under --work)")
    p.add_argument("--serve-only", action="store_true",
                   help="no checkpoint and no compile: load (validate, decode) the artifacts an earlier --keep run "
                        "left under --work, adding to its --json")
    p.add_argument("--drop-checkpoint", action="store_true",
                   help="delete the checkpoint after the last compile (frees /dev/shm before loading)")
    p.add_argument("--bound-extra-gib", type=float, default=1.0,
                   help="the RSS bound is 1.25 x weights + this (issue 20: 1 GB on the CPU host, 2 GB on the H200 host)")
    p.add_argument("--label", default="", help="a label for the JSON (e.g. before / after)")
    p.add_argument("--timeout", type=float, default=3000)
    p.add_argument("--json", default=None, help="write the results here (rewritten after each stage)")
    args = p.parse_args(argv)
    bootstrap()
    import shutil

    if args.serve_only:
        return serve_only(args)
    doc: dict = {"benchmark": "bench_scale", "label": args.label, "params": args.params, "shape": llama_config(args.params),
                 "host_cpus": os.cpu_count(), "rows": [], "commit": _commit()}

    def save(stage: str) -> None:  # partial results survive a timeout
        doc["last_stage"] = stage
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")

    t0 = time.perf_counter()
    model = build_checkpoint(args.params, Path(args.cache))
    wbytes = weight_bytes(model)
    doc.update(weight_bytes=wbytes, weight_gib=gib(wbytes), checkpoint=str(model),
               checkpoint_s=round(time.perf_counter() - t0, 1))
    t1 = time.perf_counter()
    if hasattr(os, "sync"):  # POSIX: the compile starts with the checkpoint at rest, as a downloaded one is
        os.sync()
    doc["sync_s"] = round(time.perf_counter() - t1, 1)
    save("checkpoint")
    print(f"checkpoint {model}: {gib(wbytes)} GiB ({t1 - t0:.1f} s, then sync {doc['sync_s']} s)", file=sys.stderr)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-scale-"))
    bound = 1.25 * wbytes + args.bound_extra_gib * (1 << 30)
    targets = [t for t in args.targets.split(",") if t]
    rows = doc["rows"]
    try:
        for n, target in enumerate(targets):
            art = work / f"art-{target}"
            # a cache per target: each compile is cold (no capture reused from the previous target)
            env = dict(os.environ, PORTLAYER_CACHE=str(work / f"cache-{target}"), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
            env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
            row: dict = {"target": target}
            rows.append(row)
            c = run_child("compile", model, target, art, env, False, args.timeout)
            row["compile"] = c
            if "error" not in c:
                row["compile_s"] = c["seconds"]
                row["compile_cpu_s"] = c.get("cpu_s")
                row["peak_rss_compile_gib"] = gib(c["peak_rss"])
                row["rss_over_weights"] = round(c["peak_rss"] / wbytes, 3)
                row["bound_gib"] = gib(bound)
                row["within_bound"] = c["peak_rss"] <= bound
            save(f"compile {target}")
            if args.drop_checkpoint and n == len(targets) - 1:
                shutil.rmtree(model, ignore_errors=True)
                doc["checkpoint_dropped"] = True
            if "error" not in c:
                serve(row, args, model, target, art, env, wbytes, save)
            print(json.dumps({k: v for k, v in row.items() if k not in ("compile", "load")}), file=sys.stderr)
            if not args.keep:
                shutil.rmtree(art, ignore_errors=True)
            shutil.rmtree(work / f"cache-{target}", ignore_errors=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    save("done")
    print(json.dumps(doc, indent=1))
    return 0 if all("error" not in r["compile"] for r in rows) else 1


def serve(row: dict, args: argparse.Namespace, model: Path, target: str, art: Path, env: dict[str, str], wbytes: int,
          save: Any) -> None:
    """Load (validate) and decode-time ``art`` into ``row``, as the options ask."""
    runnable = target.startswith("cpu") or _has_gpu()
    if not args.no_load:
        what = "load" if runnable else "load-only"
        lo = run_child(what, model, target, art, env, args.validate and runnable, args.timeout)
        row["load"] = lo
        if "error" not in lo:
            row["load_s"] = lo.get("load_s", lo["seconds"])
            row["peak_rss_load_gib"] = gib(lo["peak_rss"])
        save(f"load {target}")
    if args.decode and runnable:
        row["decode_b1"] = decode_b1(art, env, wbytes, args.timeout)
        save(f"decode {target}")


def serve_only(args: argparse.Namespace) -> int:
    """The second half of a two-call run: the kept artifacts under --work, loaded, validated, decode-timed."""
    import shutil

    if not args.work:
        print("--serve-only needs --work: the directory where the compile run kept its artifacts", file=sys.stderr)
        return 2
    work = Path(args.work)
    jpath = Path(args.json) if args.json else None
    doc = json.loads(jpath.read_text()) if jpath is not None and jpath.is_file() else {
        "benchmark": "bench_scale", "label": args.label, "params": args.params, "rows": []}
    doc["serve_commit"] = _commit()

    def save(stage: str) -> None:
        doc["last_stage"] = stage
        if jpath is not None:
            jpath.write_text(json.dumps(doc, indent=1) + "\n")

    failed = False
    for target in [t for t in args.targets.split(",") if t]:
        art = work / f"art-{target}"
        row = next((r for r in doc["rows"] if r.get("target") == target), None)
        if row is None:
            row = {"target": target}
            doc["rows"].append(row)
        if not (art / "manifest.json").is_file():
            row["serve_error"] = (f"no artifact at {art}: the compile run's files are not on this machine (a fresh "
                                  "machine, or the compile did not finish); run the compile stage first")
            print(row["serve_error"], file=sys.stderr)
            save(f"serve {target}: no artifact")
            failed = True
            continue
        files = json.loads((art / "manifest.json").read_text())["files"]
        wbytes = int(doc.get("weight_bytes") or sum(int(f.get("bytes", 0)) for f in files.values() if f.get("kind") == "weights"))
        env = dict(os.environ, PORTLAYER_CACHE=str(work / f"cache-{target}"), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        serve(row, args, Path(doc.get("checkpoint") or "-"), target, art, env, wbytes, save)
        print(json.dumps({k: v for k, v in row.items() if k not in ("compile", "load")}), file=sys.stderr)
        if not args.keep:
            shutil.rmtree(art, ignore_errors=True)
            shutil.rmtree(work / f"cache-{target}", ignore_errors=True)
    save("done")
    print(json.dumps(doc, indent=1))
    return 1 if failed or any("error" in r.get("load", {}) for r in doc["rows"]) else 0


def decode_b1(art: Path, env: dict[str, str], wbytes: int, timeout: float) -> dict:
    """ms per decode step at batch 1 (bench_serving.py on the artifact), and the weight-read floor
    (weight bytes / the descriptor's memory bandwidth) it is compared with."""
    out = art.parent / f"{art.name}-decode.json"
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "bench_serving.py"), "--artifact", str(art),
           "--decode-batches", "1", "--skip-serving", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out.is_file():
        return {"error": f"bench_serving exited {proc.returncode}", "stderr_tail": proc.stderr[-2000:]}
    step = json.loads(out.read_text())["decode"][0]["step_ms"]
    bw = json.loads((art / "capability.json").read_text()).get("memory", {}).get("bandwidth_gbps")
    floor = round(1000 * wbytes / (bw * 1e9), 3) if bw else None
    return {"step_ms": step, "floor_ms": floor, "of_floor": round(floor / step, 3) if floor else None}


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
