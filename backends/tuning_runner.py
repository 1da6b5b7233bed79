"""Autotuning on the real device: per kernel family, time the model's own steps under each candidate config.

The candidates come from capabilities/tuning_space.py; each one regenerates the program with
that family's config replaced (backends/generate.py's ``launch`` knob, everything else as the
Plan says), loads it and runs a decode step at ``batch`` and a prefill, as the runtime runs them
(CUDA graphs where the Plan captures; on CUDA its kernels compiled ahead of time as an artifact ships them,
with programmatic dependent launch where the descriptor has it). On CUDA what is compared is the device
time of that family's kernels (the CUDA profiler), not the steps' wall time, which is mostly host launch
cost; a family's PDL_TRIGGER is then decided by the whole steps' device time (it moves the kernels
after it). Families are tuned one after another, each against the defaults
of the others; an entry keeps the default unless a candidate is faster. The result is a
capabilities/tuning.py file the next compile's Plan reads.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from portlayer.capabilities.requirements import ModelRequirements
from portlayer.capabilities.tuning import TuningFile, shape_key, toolchain
from portlayer.capabilities.tuning_space import candidates
from portlayer.flatten.ir import Graph
from portlayer.flatten.logits import feed_last_rows
from portlayer.flatten.op_defs.attention import AttentionMetadata

MARGIN = 0.02  # a candidate must beat the default by 2% of the step to replace it


def _step_inputs(graph: Graph, lens: Sequence[int], context: Sequence[int], block: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[dict[str, torch.Tensor], AttentionMetadata, list]:
    """Feeds, metadata and a paged KV cache for one step: sequence b owns a contiguous run of blocks."""
    total = [c + n for c, n in zip(context, lens)]
    per = max(1, -(-max(total) // block))
    md = AttentionMetadata.from_lens(list(lens), device=device)
    md.seq_lens = torch.tensor(total, dtype=torch.int32, device=device)
    md.max_seq_len = max(total)
    md.block_tables = torch.arange(len(lens) * per, dtype=torch.int32, device=device).view(len(lens), per)
    slots = [(b * per + p // block) * block + p % block for b, (c, n) in enumerate(zip(context, lens))
             for p in range(c, c + n)]  # fmt: skip
    md.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    types = graph.value_types()
    caches = []
    for n in graph.find("attention"):
        k, v = types[n.inputs[1]], types[n.inputs[2]]
        caches.append((torch.zeros(len(lens) * per, block, int(k.shape[1]), int(k.shape[2]), dtype=dtype, device=device),
                       torch.zeros(len(lens) * per, block, int(v.shape[1]), int(v.shape[2]), dtype=dtype, device=device)))
    vocab = int(graph.meta.get("vocab_size") or 2)
    g = torch.Generator().manual_seed(0)
    feeds = {"input_ids": torch.randint(0, vocab, (sum(lens),), generator=g).to(device),
             "positions": torch.cat([torch.arange(c, c + n) for c, n in zip(context, lens)]).to(device)}
    feed_last_rows(feeds, [v.name for v in graph.inputs], md)
    return feeds, md, caches


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    for _ in range(2):
        fn()
    _sync(device)
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


#: the kernel-name prefix of each launch family's kernels (codegen/kernels/*: make_kernel names them
#: "<kernel family>_<variant>_<digest>"); families not listed here use "<family>_"
KERNEL_PREFIX = {"attention_decode": ("attn_decode_",), "attention_prefill": ("attn_prefill_",)}


def kernel_prefixes(family: str) -> tuple[str, ...]:
    return KERNEL_PREFIX.get(family, (f"{family}_",))


def family_kernel(name: str, family: str) -> bool:
    """Whether the kernel ``name`` is one of ``family``'s: its prefix, and not that of a longer family that shares
    it (gemv_wq_* kernels read launch.gemv_wq, not launch.gemv)."""
    from portlayer.capabilities.plan import LAUNCH_FAMILIES

    longer = tuple(p for f in LAUNCH_FAMILIES if f != family and f.startswith(family) for p in kernel_prefixes(f))
    return name.startswith(kernel_prefixes(family)) and not name.startswith(longer)


def busy_us(intervals: Sequence[tuple[float, float]]) -> float:
    """How long the device was running any of these (start, end) kernel intervals: overlaps counted once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def family_device_us(fns: Sequence[Callable[[], Any]], family: str, iters: int, rounds: int = 3,
                     whole_steps: bool = False) -> tuple[float, int]:
    """Device microseconds per call-set of ``family``'s kernels, and their launches per set: each of ``fns``
    (the decode steps and a prefill) run ``iters`` times under the CUDA profiler, the kernels whose names start
    with the family's prefix summed; the best of ``rounds``. Kernel time alone: a step's wall time is
    mostly host launch cost and the other families, whose noise picked wrong configs (-30% at batch 1).
    ``whole_steps``: the time the device ran any kernel instead (overlaps once, host gaps not counted), for a
    family whose candidates change when the next kernel may start (launch.<family>'s PDL_TRIGGER): under
    programmatic dependent launch that shows in the kernels after the family's, not in its own."""
    from torch.profiler import ProfilerActivity, profile

    best, launches = float("inf"), 0
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    for _ in range(max(1, rounds)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                for fn in fns:
                    fn()
            torch.cuda.synchronize()
        hits = [e for e in prof.key_averages() if family_kernel(e.key, family)]
        launches = round(sum(e.count for e in hits) / iters)
        if whole_steps:
            kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
                       and "Memset" not in e.name]  # fmt: skip
            best = min(best, busy_us(kernels) / iters)
        else:
            best = min(best, sum(e.device_time_total for e in hits) / iters)
    return best, launches


def whole_step_metric(family: str, default: dict[str, int], descriptor: Any) -> bool:
    """Whether ``family`` has a PDL trigger to compare on this device, by the steps' device time (family_device_us's
    whole_steps: the trigger moves the kernels after the family's, which its own kernel time cannot show)."""
    return "PDL_TRIGGER" in default and descriptor.has("programmatic_dependent_launch")


def trigger_only(cfg: dict[str, int], default: dict[str, int]) -> bool:
    """Whether ``cfg`` differs from ``default`` in its PDL_TRIGGER alone."""
    return {k for k in cfg if cfg[k] != default.get(k)} == {"PDL_TRIGGER"}


def _pick_trigger(timer: Any, family: str, cfg: dict[str, int], say: Callable[[str], None]) -> dict[str, int]:
    """``cfg`` or ``cfg`` with the other PDL_TRIGGER, by the whole steps' device time, when the kernels launched
    under programmatic dependent launch (binaries compiled with it); under the JIT the two are one kernel."""
    flipped = {**cfg, "PDL_TRIGGER": 3 - int(cfg["PDL_TRIGGER"])}
    try:
        a = timer({family: cfg}, family, True)
        if not timer.pdl:
            say(f"tune {family}: PDL_TRIGGER not compared: the kernels did not launch under programmatic dependent "
                "launch here (no binaries), where both values are the same kernel")
            return cfg
        b = timer({family: flipped}, family, True)
    except Exception as e:  # noqa: BLE001 - a failed comparison keeps the config the first pass chose
        say(f"tune {family}: PDL_TRIGGER comparison failed ({type(e).__name__}: {str(e)[:120]}); kept {cfg}")
        return cfg
    keep = b >= a * (1 - MARGIN)
    say(f"tune {family}: PDL_TRIGGER {cfg['PDL_TRIGGER']} {a:.1f} us vs {flipped['PDL_TRIGGER']} {b:.1f} us of the "
        f"whole steps (device time, overlaps once); {'kept' if keep else 'took'} {flipped['PDL_TRIGGER'] if not keep else cfg['PDL_TRIGGER']}")
    return cfg if keep else flipped


class StepTimer:
    """Generates, loads and times the program under one launch override."""

    def __init__(self, graph: Graph, plan: Any, descriptor: Any, device: str, batch: int | Sequence[int], context: int,
                 prefill: int, iters: int, workdir: Path) -> None:
        self.graph, self.plan, self.descriptor = graph, plan, descriptor
        self.device = torch.device(device)
        self.iters, self.workdir, self.n = iters, workdir, 0
        dtype = getattr(torch, str(plan.kv_cache_dtype or plan.compute_dtype))  # the caches the program reads
        block = int(plan.kv_block_size or 16)
        batches = [batch] if isinstance(batch, int) else list(batch)
        self.steps = [_step_inputs(graph, [1] * b, [context] * b, block, dtype, self.device) for b in batches]
        self.steps.append(_step_inputs(graph, [prefill], [0], block, dtype, self.device))
        self.launches: dict[str, int] = {}  # family -> its kernels' launches per set of steps
        self.pdl = False  # the last program's kernels launched from binaries compiled for programmatic dependent launch

    def _load(self, out: Path) -> Any:
        """The candidate's program as an artifact runs it: on CUDA its kernels compiled ahead of time for the
        descriptor (with PDL where it has the feature, calibration_runner.with_binaries), else Triton's JIT."""
        from portlayer.backends.calibration_runner import launcher, with_binaries
        from portlayer.backends.triton_program import load_program
        from portlayer.codegen.aot import PDL_FEATURE
        from portlayer.codegen.kernel_binaries import KernelBinaryError

        prog = None
        src = with_binaries(out, self.descriptor) if self.device.type == "cuda" else None
        if src is not None:
            try:
                prog = load_program(out, self.graph.weights, str(self.device), self.plan, sources=src)
            except KernelBinaryError:  # binaries for another arch or driver: the JIT
                prog = None
        if prog is None:
            prog = load_program(out, self.graph.weights, str(self.device), self.plan)
        self.pdl = launcher(prog) == "binaries" and self.descriptor.has(PDL_FEATURE)
        return prog

    def __call__(self, launch: dict[str, dict[str, int]], family: str | None = None, whole_steps: bool = False) -> float:
        """Microseconds under ``launch``: on CUDA the device time of ``family``'s kernels in one decode step per
        batch plus one prefill (the CUDA profiler; ``whole_steps``: of all kernels, overlaps once); elsewhere, or
        when none of its kernels ran, the steps' wall time."""
        from portlayer.backends.generate import generate
        from portlayer.codegen.program import write_program

        self.n += 1
        out = self.workdir / f"candidate-{self.n}"
        write_program(generate(self.graph, self.plan, self.descriptor, launch=launch), out)
        prog = self._load(out)
        steps = [lambda s=s, p=prog: p.run(*s) for s in self.steps]
        with torch.inference_mode():
            t, n = (family_device_us(steps, family, self.iters, whole_steps=whole_steps)
                    if family and self.device.type == "cuda"
                    else (0.0, 0))  # fmt: skip
            if n:
                self.launches[family] = n
            else:
                t = sum(_time(fn, self.device, self.iters) for fn in steps)
        del prog, steps  # its weights, buffers and captured graphs: one candidate's program on the device at a time
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return t


def tune(graph: Graph, plan: Any, descriptor: Any, device: str = "cuda", *, batch: int | Sequence[int] = 16,
         context: int = 128, prefill: int = 128, iters: int = 10, families: Sequence[str] | None = None, limit: int = 6,
         say: Callable[[str], None] = print, existing: TuningFile | None = None, budget_s: float | None = None,
         on_family: Callable[[TuningFile], None] | None = None) -> TuningFile:
    """Search each family's candidates; the tuning file for ``descriptor`` and this toolchain.

    ``budget_s``: no family is started once the time spent plus the slowest family so far would pass it
    (the families left keep their defaults, said so); ``on_family`` gets the file after each family, so
    a run cut short keeps what it found (`portlayer tune` saves there)."""
    req_json = (getattr(plan, "inputs", None) or {}).get("requirements")  # the ones the Plan was negotiated from
    req = ModelRequirements.from_json(req_json) if req_json else ModelRequirements.from_graph(graph)
    shape = shape_key(req, str(plan.compute_dtype))
    out = existing or TuningFile(descriptor.name, descriptor.sha256, toolchain())
    defaults = {d.name.removeprefix("launch."): dict(d.value) for d in plan
                if d.name.startswith("launch.") and isinstance(d.value, dict) and d.value}  # fmt: skip
    used = {k.get("family") for k in graph.meta.get("kernels", [])} | {"attention_decode", "attention_prefill",
                                                                        "reshape_and_cache"}  # fmt: skip
    if "gemm" in used:  # a GEMM group runs the few-rows kernel at decode sizes (codegen/gemm_rule.py)
        used.add("gemv")
        if graph.find("linear_wq"):  # quantized: the few-rows GEMV without a fused norm, the dequantize kernel
            used |= {"gemv_wq", "dequant"}
    fams = [f for f in (families or defaults) if f in defaults and (f in used or families)]
    with tempfile.TemporaryDirectory(prefix="portlayer-tune-") as tmp:
        start, slowest = time.perf_counter(), 0.0
        timer = StepTimer(graph, plan, descriptor, device, batch, context, prefill, iters, Path(tmp))
        for i, fam in enumerate(fams):
            spent = time.perf_counter() - start
            if budget_s is not None and spent + slowest > budget_s:
                say(f"tune: budget {budget_s:.0f}s reached after {spent:.0f}s; left at their defaults: {', '.join(fams[i:])}")
                break
            cands = candidates(fam, defaults[fam], descriptor, str(plan.compute_dtype), limit)
            flips = [c for c in cands[1:] if trigger_only(c, cands[0])]  # compared by whole steps, after the rest
            cands = [c for c in cands if c not in flips]
            t0 = time.perf_counter()
            times = []
            for j, cfg in enumerate(cands):
                try:
                    times.append(timer({fam: cfg}, fam))
                    say(f"tune {fam}: candidate {j + 1}/{len(cands)} {cfg}: {times[-1]:.1f} us")
                except Exception as e:  # a config this kernel cannot compile with is a failed candidate, not a crash
                    say(f"tune {fam}: {cfg} failed ({type(e).__name__}: {str(e)[:120]})")
                    times.append(float("inf"))
                if len(times) == 1 and timer.device.type == "cuda" and fam not in timer.launches:
                    break  # the default ran no kernel of this family: nothing of it to compare
            if timer.device.type == "cuda" and fam not in timer.launches and times[0] != float("inf"):
                say(f"tune {fam}: no kernel of this family ran in the timed steps (the plan does not launch it "
                    "for this model here); left at its default, no entry written")
                continue
            best = min(range(len(cands)), key=lambda i: times[i])
            if times[0] == float("inf"):
                say(f"tune {fam}: the default config failed to run; family left untuned")
                continue
            if times[best] >= times[0] * (1 - MARGIN):  # within the noise of a step: keep the default
                best = 0
            chosen = cands[best]
            if flips and whole_step_metric(fam, chosen, descriptor):
                chosen = _pick_trigger(timer, fam, chosen, say)
            out.put(fam, shape, chosen, times[best], times[0], cands[0], len(cands) + len(flips))
            n = timer.launches.get(fam)
            say(f"tune {fam}: {len(cands)} candidates in {time.perf_counter() - t0:.1f}s; default {times[0]:.1f} us, "
                f"best {times[best]:.1f} us {chosen}{' (the default)' if chosen == cands[0] else ''}; "
                + (f"device time of its {n} kernel launches" if n else "wall time of the timed steps (no CUDA profiler "
                   "here)"))
            slowest = max(slowest, time.perf_counter() - t0)
            if on_family is not None:
                on_family(out)
    return out
