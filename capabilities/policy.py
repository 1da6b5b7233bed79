"""The negotiator: (model requirements, capability descriptor) -> Plan.

Every number comes from the descriptor or the model, never from the device's name, so
an edited descriptor gives a different plan with no code change, and every decision
says which numbers drove it. Pure and deterministic: same inputs, same plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from portlayer.capabilities.descriptor import Descriptor, load_descriptor
from portlayer.capabilities.plan import LAUNCH_FAMILIES, Decision, Plan, PlanError
from portlayer.capabilities.requirements import ITEMSIZE, ModelRequirements

__all__ = ["ModelRequirements", "Plan", "Decision", "PlanError", "negotiate", "plan_for_graph"]

#: overrides key carrying the quality gate's rejections {format: measured reason} into plan_for_graph
GATE_REJECTED = "quality_gate_rejected"
DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
GiB = 2**30


def _pow2_ceil(n: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


def system_memory_bytes() -> int:
    """Physical memory of this host (what an iGPU with unified memory shares)."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


class _Negotiation:
    """Decisions in dependency order; each method appends one Decision."""

    def __init__(self, req: ModelRequirements, desc: Descriptor, overrides: Mapping[str, Any],
                 quality: Mapping[str, Any] | None = None) -> None:
        self.r, self.d, self.o = req, desc, dict(overrides)
        self.q = dict(quality or {})  # {"native": "Q4_1", "rejected": {format: measured reason}}
        self.out: list[Decision] = []
        self.v: dict[str, Any] = {}

    def add(self, name: str, value: Any, reason: str) -> None:
        if name in self.o:
            value, reason = self.o[name], f"user override (policy would pick {value!r}: {reason})"
        self.out.append(Decision(name, value, reason))
        self.v[name] = value

    # ---- memory ------------------------------------------------------------------
    def usable_fraction(self) -> tuple[float, str]:
        d = self.d
        if d.device_type == "cpu":
            return 0.5, "CPU: half of host memory, the rest belongs to the OS and other processes"
        if d.memory.unified_with_host:
            return 0.5, "memory is unified with the host: half is left to the OS and the host process"
        return 0.9, "discrete memory: 90% usable (vLLM's gpu_memory_utilization default)"

    def compute_dtype(self) -> None:
        d = self.d
        bf16, fp16 = d.tflops("bf16"), d.tflops("fp16")
        if d.device_type == "cpu":
            self.add("compute_dtype", "float32", "CPU target: float32 unless asked (--dtype); " + (f"bf16 {bf16:g} TFLOP/s" if bf16 else "bf16 absent"))
            return
        for p in d.preferred_dtypes:
            if d.tflops(p):
                src = d.source("preferred_dtypes")
                self.add("compute_dtype", p, f"descriptor prefers {list(d.preferred_dtypes)} ({src})")
                return
        if bf16 and fp16 and bf16 >= 0.9 * fp16:
            why = f"bf16 at {bf16:g} TFLOP/s matches fp16 ({fp16:g}) and keeps fp32's exponent range"
            self.add("compute_dtype", "bfloat16", why)
        elif fp16:
            why = f"fp16 at {fp16:g} TFLOP/s; bf16 is " + (f"slower ({bf16:g})" if bf16 else f"absent on {d.arch}")
            self.add("compute_dtype", "float16", why)
        elif bf16:
            self.add("compute_dtype", "bfloat16", f"bf16 at {bf16:g} TFLOP/s; fp16 absent")
        else:
            self.add("compute_dtype", "float32", "neither bf16 nor fp16 is listed in throughput_tflops")

    def tensor_parallel(self) -> None:
        """The tensor-parallel degree: 1, the user's N, or (``auto``) the smallest N whose per-rank
        weights plus one full-length sequence of KV cache fit (capabilities/tp_degree.py)."""
        from portlayer.capabilities.tp_degree import auto_degree, check_degree

        want = self.o.pop("tensor_parallel", None)
        frac, _ = self.usable_fraction()
        if want in (None, 1, "1"):
            self.out.append(Decision("tensor_parallel", 1, "one device (pass --tensor-parallel N or auto to shard)"))
            self.v["tensor_parallel"] = 1
            return
        if want == "auto":
            n, why = auto_degree(self.r, self.d, self.v["compute_dtype"], frac)
        else:
            n = check_degree(self.r, self.d, int(want))
            why = f"user override: --tensor-parallel {n}"
        self.out.append(Decision("tensor_parallel", n, why))
        self.v["tensor_parallel"] = n

    def weight_quantization(self) -> None:
        r, d, dt = self.r, self.d, self.v["compute_dtype"]
        frac, _ = self.usable_fraction()
        budget = d.memory.capacity_bytes * frac
        w = r.param_bytes_at(dt) // self.v.get("tensor_parallel", 1)  # per rank
        if w > budget:
            for q in ("int8", "int4"):
                if r.param_bytes_at(q) <= budget:
                    self._pick_quantization(q, f"{dt} weights ({_gib(w)}) exceed the {_gib(budget)} budget; {q} fits", budget)
                    return
            raise PlanError(
                f"model {r.name} needs {_gib(r.param_bytes_at('int4'))} of weights even at int4, but {d.name} "
                f"({d.origin}) offers {_gib(budget)}; pick a device with more memory or a smaller model"
            )
        if d.device_type == "cpu":
            self._pick_quantization("none", f"CPU target: weights stay {dt} ({_gib(w)} fit)", budget)
            return
        int4, peak = d.tflops("int4"), d.tflops(dt) or 0.0
        intensity = r.flops_per_token / max(1, r.bytes_per_token / r.itemsize * ITEMSIZE[dt])
        ridge = peak * 1e12 / (d.memory.bandwidth_gbps * 1e9) if peak else 0.0
        memory_bound = intensity < ridge
        if int4 and peak and int4 >= 2 * peak and memory_bound:
            why = (
                f"decode at batch 1 does {intensity:.1f} FLOP/byte, below the ridge {ridge:.0f} (memory-bound), and "
                f"int4 runs at {int4:g} TOP/s >= 2x {DTYPE_SHORT.get(dt, dt)} {peak:g}: weight-only int4 reads {ITEMSIZE[dt] / 0.5:g}x fewer bytes"
            )
            self._pick_quantization("int4", why, budget)
            return
        int4_txt = f"int4 {int4:g} < 2x {peak:g}" if int4 else "int4 absent"
        bound = "memory-bound" if memory_bound else "compute-bound"
        self._pick_quantization("none", f"weights ({_gib(w)}) fit; {int4_txt}; decode is {bound}", budget)

    # ---- quantization vs the quality gate (passes/quality_gate.py) --------------------------
    def _pick_quantization(self, pick: str, why: str, budget: float) -> None:
        """The policy's pick, unless the model ships native blocks (kept) or the quality gate measured
        the pick below its thresholds (then the next format that fits, with the measured reason)."""
        native, rejected = self.q.get("native"), dict(self.q.get("rejected") or {})
        if native and "native" not in rejected:
            self.add("weight_quantization", "native",
                     f"the model file ships {native} blocks: kept as they are (linear_wq, group 32), the numbers "
                     f"its authors shipped, not re-quantized (otherwise: {pick}, {why})")
            return
        chain = [pick] + (["int8"] if pick == "int4" else []) + (["none"] if pick != "none" else [])
        notes = [f"{rej} rejected by the quality gate ({rejected[rej]})" for rej in rejected if rej != "native"]
        if "native" in rejected:
            notes.insert(0, f"native {native} rejected by the quality gate ({rejected['native']})")
        for q in chain:
            if q in rejected:
                continue
            fits = self.r.param_bytes_at(self.v["compute_dtype"] if q == "none" else q) <= budget
            if q == pick:
                self.add("weight_quantization", q, "; ".join([why, *notes]))
                return
            if fits:
                self.add("weight_quantization", q, f"policy pick {pick} ({why}) fell back: " + "; ".join(notes) + f"; {q} fits")
                return
        self.add("weight_quantization", pick, f"{why}; " + "; ".join(notes) + "; nothing that passes the gate fits memory, so kept")

    def buffer_alignment(self) -> None:
        a = self.d.memory.alignment_bytes
        self.add("buffer_alignment", a, f"memory.alignment_bytes = {a} ({self.d.source('memory.alignment_bytes')})")

    def kv_cache_dtype(self) -> None:
        r, d, dt = self.r, self.d, self.v["compute_dtype"]
        if not r.needs_kv_cache:
            self.add("kv_cache_dtype", None, f"task {r.task!r} keeps no KV cache")
            return
        asked = self.o.get("kv_cache_dtype")
        if asked and not asked.startswith("float8") and asked != dt and d.codegen != "torch":
            raise PlanError(f"--kv-cache-dtype {asked}: the {d.codegen} kernels keep the KV cache in the compute dtype "
                            f"({dt}) or a float8 type the descriptor lists; use {dt} (or --dtype {asked})")
        fp8 = [x for x in d.kv_cache_dtypes if x.startswith("float8")]
        why = "the compute dtype"
        if fp8:  # lossy: asked for, never picked (its speed and accuracy measured in docs/performance.md)
            why += (f"; the device's kernels also read {fp8[0]} caches ({d.source('kv_cache.dtypes')}): half the "
                    "bytes a token, twice the tokens a GiB, a faster decode attention from 16 sequences up and a "
                    "slower one at one (docs/performance.md), at a measured accuracy cost (SmolLM2-135M: 2% of its "
                    f"next tokens differ); --kv-cache-dtype {fp8[0]} asks for it")
        self.add("kv_cache_dtype", dt, why)

    def kv_block_size(self) -> None:
        r, d = self.r, self.d
        if not r.needs_kv_cache:
            self.add("kv_block_size", None, f"task {r.task!r} keeps no KV cache")
            return
        per_layer = int(r.kv_bytes_per_token_per_layer / r.itemsize * ITEMSIZE[self.v["kv_cache_dtype"]])
        note = ""
        if d.max_head_dim and max(r.head_dims or (0,)) > d.max_head_dim:
            note = f"; head_dim {max(r.head_dims)} > the device kernel limit {d.max_head_dim}: attention uses the fallback"
        if d.kv_block_sizes:
            bs = max(d.kv_block_sizes)
            self.add("kv_block_size", bs, f"the device's paged-attention kernels take {list(d.kv_block_sizes)} ({d.source('kv_cache.block_sizes')}){note}")
            return
        bs, align = 16, d.memory.alignment_bytes
        why = "16 tokens: vLLM's default, small blocks waste few slots per sequence"
        while (bs * per_layer) % align and bs < 256:
            bs *= 2
        if bs != 16:
            why += f"; raised to {bs} so one layer's block ({bs * per_layer} B) is a multiple of {align} B"
        self.add("kv_block_size", bs, why + note)

    def prefill_chunk_size(self) -> None:
        r, d, dt = self.r, self.d, self.v["compute_dtype"]
        if r.task != "causal_lm":
            self.add("prefill_chunk_size", r.max_positions, "bidirectional attention cannot be chunked: whole sequences")
            return
        peak = (d.tflops(dt) or d.tflops("fp32") or 1.0) * 1e12
        ridge = peak / (d.memory.bandwidth_gbps * 1e9)
        tokens = ridge * ITEMSIZE[dt] / 2  # a GEMM over T tokens does 2T FLOP per weight byte/itemsize
        chunk = _clamp(_pow2_ceil(4 * tokens), 256, 8192)
        chunk = min(chunk, _pow2_ceil(r.max_positions))
        bs = self.v.get("kv_block_size") or 1
        chunk = max(bs, chunk // bs * bs)
        why = (
            f"GEMMs turn compute-bound at ~{tokens:.0f} tokens ({peak / 1e12:g} TFLOP/s / {d.memory.bandwidth_gbps:g} GB/s); "
            f"4x that, rounded to a power of two in [256, 8192]"
        )
        self.add("prefill_chunk_size", chunk, why)

    def activation_bytes_per_token(self) -> int:
        r = self.r
        return int((4 * r.hidden_size + 3 * r.intermediate_size + r.vocab_size) * ITEMSIZE[self.v["compute_dtype"]])

    def max_batched_tokens(self) -> None:
        d, chunk = self.d, self.v["prefill_chunk_size"]
        frac, _ = self.usable_fraction()
        act = max(1, self.activation_bytes_per_token())
        cap = int(d.memory.capacity_bytes * frac * 0.1 // act)
        if d.dma_engines >= 2:
            n, why = 2 * chunk, f"a prefill chunk plus a decode batch: {d.dma_engines} DMA engines overlap transfers with compute"
        else:
            n, why = chunk, f"one prefill chunk: {d.dma_engines} DMA engine(s), no overlap to exploit"
        if n > cap:
            n, why = max(1, cap), f"activations ({act} B/token) may use 10% of usable memory: {cap} tokens"
        self.add("max_batched_tokens", n, why)

    def kv_cache_budget(self) -> None:
        r, d, dt = self.r, self.d, self.v["compute_dtype"]
        if not r.needs_kv_cache:
            self.add("kv_cache_budget_bytes", 0, f"task {r.task!r} keeps no KV cache")
            self.add("max_kv_tokens", 0, "no KV cache")
            return
        frac, frac_why = self.usable_fraction()
        usable = d.memory.capacity_bytes * frac
        if d.memory.unified_with_host and d.device_type != "cpu":  # an iGPU: its memory IS system memory
            ram = system_memory_bytes()
            usable = min(ram, d.memory.capacity_bytes) * frac
            frac_why = (f"{frac_why}; unified memory: min({_gib(ram)} system memory on this host, the descriptor's "
                        f"{_gib(d.memory.capacity_bytes)} driver share)")
        q = self.v["weight_quantization"]
        weights = r.param_bytes_at(q if q in ("int8", "int4") else dt) // self.v.get("tensor_parallel", 1)  # per rank
        act = 2 * self.v["max_batched_tokens"] * self.activation_bytes_per_token()
        budget = int(usable - weights - act)
        why = f"{frac_why}: {_gib(usable)} - weights {_gib(weights)} - activations {_gib(act)}"
        if d.device_type == "cpu" and budget > 4 * GiB:
            budget, why = 4 * GiB, why + "; capped at 4 GiB on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE default)"
        if budget <= 0:
            raise PlanError(
                f"model {r.name} leaves no room for a KV cache on {d.name} ({why}); quantize the weights "
                "(--quantization int8) or pick a larger device"
            )
        self.add("kv_cache_budget_bytes", budget, why)
        per_tok = r.kv_bytes_per_token_at(self.v["kv_cache_dtype"] or dt)
        if self.v.get("tensor_parallel", 1) > 1:  # this rank's KV heads only
            from portlayer.capabilities.tp_degree import kv_heads_per_rank

            per_tok = per_tok * kv_heads_per_rank(r, self.v["tensor_parallel"]) // max(1, r.num_kv_heads)
        self.add("max_kv_tokens", budget // per_tok,
                 f"{_gib(budget)} / {per_tok} B per token ({r.num_layers} layers, {self.v['kv_cache_dtype']})")

    def max_num_seqs(self) -> None:
        kv_tokens, bs = self.v["max_kv_tokens"], self.v["kv_block_size"]
        n = min(256, self.v["max_batched_tokens"])
        why = "256 sequences (vLLM's default), at most max_batched_tokens"
        if kv_tokens and bs and kv_tokens // bs < n:
            n, why = max(1, kv_tokens // bs), f"the KV cache holds only {kv_tokens // bs} blocks of {bs}"
        self.add("max_num_seqs", n, why)

    def graph_capture_sizes(self) -> None:
        d = self.d
        if not d.has("graph_capture") or d.codegen == "torch":
            overhead = f" (~{d.raw.get('launch_overhead_us')} us each)" if d.raw.get("launch_overhead_us") else ""
            self.add("graph_capture_sizes", [], f"{d.name} lacks graph_capture: decode launches kernels eagerly{overhead}")
            return
        top = self.v["max_num_seqs"]
        sizes = [s for s in [1, 2, 4, 8, *range(16, 257, 16)] if s <= top]
        self.add("graph_capture_sizes", sizes, f"graph_capture feature: buckets 1,2,4,8 then every 16 up to max_num_seqs {top}")

    def step_graph_tokens(self) -> None:
        """Token buckets of the CUDA graphs of steps with prefill tokens (codegen/step_graphs.py): eager, such a
        step launches ~12 kernels a layer from the host, slower than its kernels run (session 18, the H200)."""
        d, r = self.d, self.r
        why = None
        if not r.needs_kv_cache:
            why = f"task {r.task!r} keeps no KV cache (its steps run without one, eagerly)"
        elif not self.v["graph_capture_sizes"]:
            why = "no decode graphs"
        elif d.codegen != "triton":
            why = f"codegen {d.codegen!r} captures no step graphs"
        elif self.v.get("tensor_parallel", 1) > 1:  # every rank must decide alike, and a capture can fail on one
            why = (f"tensor parallel over {self.v['tensor_parallel']} ranks: a step graph that failed to capture on one "
                   "rank would leave its collectives out of step with the others'")
        if why:
            self.add("step_graph_tokens", [], f"{why}: steps with prefill tokens launch their kernels eagerly")
            return
        top = self.v["max_batched_tokens"]
        sizes = [s for s in (16, 32, 64, 128) if s < top] + list(range(256, top + 1, 256))
        if not sizes or sizes[-1] != top:
            sizes.append(top)
        self.add("step_graph_tokens", sizes, f"graph_capture feature, Triton codegen: 16..128 doubling, then every 256 "
                 f"up to max_batched_tokens {top} (a step pads its tokens to the next bucket)")

    # ---- kernels -------------------------------------------------------------------
    def launch_configs(self) -> None:
        d = self.d
        if d.codegen != "triton":
            for fam in LAUNCH_FAMILIES:
                self.add(f"launch.{fam}", {}, f"codegen {d.codegen!r} calls vendor/torch ops; no Triton launch config")
            return
        r, w, item = self.r, d.warp_size, ITEMSIZE[self.v["compute_dtype"]]
        smem = d.compute_units.max_shared_memory_per_block_bytes
        vec = int(16 // item)  # elements per 16-byte load

        def warps(threads: int) -> int:
            return max(1, threads // w)

        def row(n: int) -> tuple[int, int]:
            block = _pow2_ceil(n)
            return block, _clamp(_pow2_ceil(block // vec), w, 1024)

        scale = f"warp_size {w}"
        self.add("launch.pointwise", {"num_warps": warps(128), "BLOCK": 128 * vec, "num_stages": 1},
                 f"128 threads / {scale}; BLOCK = 128 threads x {vec} elements per 16-byte load")  # fmt: skip
        for fam, n in (("reduction", r.hidden_size), ("embedding", r.hidden_size)):
            block, threads = row(n)
            self.add(f"launch.{fam}", {"num_warps": warps(threads), "BLOCK_N": block, "num_stages": 1},
                     f"one row of {n} per program; {threads} threads ({block}/{vec} per 16-byte load) / {scale}")  # fmt: skip
        hd = max(r.head_dims or (64,))
        heads = max(1, r.num_heads)
        threads = _clamp(_pow2_ceil(heads * hd // 2 // vec), w, 256)
        self.add("launch.rope", {"num_warps": warps(threads), "BLOCK_H": _pow2_ceil(heads), "BLOCK_D": _pow2_ceil(hd // 2), "num_stages": 1},
                 f"all {heads} heads x {hd // 2} rotary pairs of a token per program; {threads} threads / {scale}")  # fmt: skip
        block, threads = row(max(1, r.num_kv_heads) * hd)
        self.add("launch.reshape_and_cache", {"num_warps": warps(min(threads, 256)), "BLOCK": block, "num_stages": 1},
                 f"one token's {r.num_kv_heads}x{hd} K and V per program / {scale}")  # fmt: skip
        self._gemm(smem, item, warps, scale)
        cus = d.compute_units.count
        self.add("launch.gemv", {"num_warps": warps(128), "TILE": 4096, "PROGRAMS": 2 * cus, "num_stages": 1},
                 f"few-rows GEMM: column blocks sized for >= 2 programs per compute unit ({cus} units); a W tile of "
                 f"<= 4096 elements (32 float32 products per thread of 128) / {scale}")  # fmt: skip
        self.add("launch.gemv_wq", {"num_warps": warps(256), "BLOCK_N": 4, "BLOCK_K": 256, "UNROLL": 16, "num_stages": 1,
                                     "PDL_TRIGGER": 2},
                 "weight-only quantized few-rows GEMM without a fused norm (CUDA-core tier; a norm-fused one keeps "
                 "launch.gemv's whole-K tiles): 4 columns a program, K tiles of 256 read as group-sized sub-tiles, up to "
                 "16 tiles unrolled so their loads are in flight together; measured on the H200 (docs/performance.md, "
                 "session 15: int4 Qwen3-0.6B o_proj / down_proj at 1 row, 3.8 us a launch in the model against 7.3 us "
                 "for whole-K tiles of 2 columns). PDL_TRIGGER 2: under programmatic dependent launch the next kernel "
                 "launches as these programs exit, not right after their wait (session 16: int4 decode b1 1.03 ms "
                 f"against 1.31 ms) / {scale}")  # fmt: skip
        self.add("launch.dequant", {"num_warps": warps(128), "BLOCK_N": 16, "BLOCK_K": 128, "num_stages": 1},
                 "weight-only quantized weight dequantized for the vendor GEMM (from tuning.wq_vendor_min_tokens rows): "
                 f"a 16 x 128 tile a program, 16 elements of it a thread (16-byte stores in bfloat16) / {scale}")  # fmt: skip
        self._attention(smem, item, warps, scale, hd)
        # launch configs measured on this device: the descriptor's (data shipped for the device), then a tuning
        # file's (portlayer tune on this host; capabilities/tuning.py); none: the defaults above
        from portlayer.capabilities.tuning import apply_descriptor_defaults, apply_tuning, shape_key

        self.out[:] = apply_tuning(apply_descriptor_defaults(self.out, d), d, shape_key(r, self.v["compute_dtype"]))
        self.v.update({x.name: x.value for x in self.out})

    def _gemm(self, smem: int, item: float, warps: Any, scale: str) -> None:
        for bm, bn, bk in ((128, 128, 64), (128, 64, 64), (64, 64, 64), (64, 64, 32), (32, 32, 32)):
            stage = int((bm * bk + bk * bn) * item)
            if smem // stage >= 2:
                break
        stages = _clamp(smem // stage, 1, 4)
        threads = 256 if bm * bn >= 128 * 64 else 128
        cfg = {"num_warps": warps(threads), "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_stages": stages}
        why = f"{bm}x{bn}x{bk} tile = {stage} B per stage; {smem} B shared memory per block -> {stages} stages (max 4); {threads} threads / {scale}"
        self.add("launch.gemm", cfg, why)

    def _attention(self, smem: int, item: float, warps: Any, scale: str, hd: int) -> None:
        r, bd = self.r, _pow2_ceil(hd)
        group = max(1, r.num_heads // max(1, r.num_kv_heads))
        # a program reads BLOCK_N = TILE / BLOCK_D tokens a step (gathered through the block table, so any page
        # size): a 16 KB K tile plus its V tile in flight; PROGRAMS per compute unit set a step's splits
        tile = max(16 * bd, 16384 // max(1, int(item)) // bd * bd)
        bn = tile // bd
        stage = int(2 * bn * bd * item)
        stages = _clamp(smem // max(stage, 1), 1, 3)
        cfg = {"num_warps": warps(128), "BLOCK_H": max(16, _pow2_ceil(group)), "TILE": tile, "BLOCK_D": bd,
               "num_stages": stages, "PROGRAMS": 2}
        self.add("launch.attention_decode", cfg,
                 f"{bn} tokens a step (TILE {tile} / BLOCK_D {bd}), GQA group {group} padded to >=16 rows for tl.dot; "
                 f"K+V tile {stage} B -> {stages} stages; splits per sequence until a step has 2 programs per "
                 f"compute unit; 128 threads / {scale}")
        measured = self.d.tuning.get("attention_prefill_block_m")
        bm = int(measured) if measured else 128 if smem // int((128 * bd + 2 * 64 * bd) * item) >= 2 else 64
        stage = int((bm * bd + 2 * 64 * bd) * item)
        stages = _clamp(smem // stage, 1, 3)
        threads = max(32, bm * 2)  # 32 query rows per warp (a 16-row MMA tile per half-warp group)
        cfg = {"num_warps": warps(threads), "BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_D": bd, "num_stages": stages}
        tile = (f"Q tile {bm}x{bd} (tuning.attention_prefill_block_m, measured)" if measured else f"Q tile {bm}x{bd}")
        self.add("launch.attention_prefill", cfg,
                 f"{tile} + K/V tiles 64x{bd} = {stage} B per stage in {smem} B -> {stages} stages; {threads} threads / {scale}")  # fmt: skip

    def max_fused_inputs(self) -> None:
        d = self.d
        cu = d.compute_units
        if d.codegen == "triton" and cu.registers_per_unit and cu.max_threads_per_unit:
            regs = min(255, cu.registers_per_unit // max(1, cu.max_threads_per_unit // 2))
            n = _clamp((regs - 16) // 6, 2, 16)
            why = (
                f"{cu.registers_per_unit} registers / {cu.max_threads_per_unit // 2} threads (50% occupancy) = {regs} per thread; "
                "16 reserved, 6 per input (a 16-byte vector + its address); capped to [2, 16]"
            )
        elif d.codegen == "cann" and cu.shared_memory_per_unit_bytes:
            tiles = cu.shared_memory_per_unit_bytes // (2 * 8192)
            n = _clamp(tiles - 1, 2, 16)
            why = f"{cu.shared_memory_per_unit_bytes} B on-chip buffer holds {tiles} double-buffered 8 KiB tiles, one kept for the output"
        else:
            n, why = 8, f"codegen {d.codegen!r} has no register/shared-memory limit to respect; 8 keeps fused code readable"
        self.add("max_fused_inputs", n, why)


def negotiate(
    requirements: ModelRequirements, descriptor: Descriptor | str, overrides: Mapping[str, Any] | None = None,
    quality: Mapping[str, Any] | None = None,
) -> Plan:
    """The Plan for a model on a device; ``overrides`` force decisions (reason 'user override');
    ``quality``: native block formats of the source and the quality gate's rejections."""
    desc = load_descriptor(descriptor) if not isinstance(descriptor, Descriptor) else descriptor
    overrides = dict(overrides or {})
    bad_dtype = overrides.get("compute_dtype")
    if bad_dtype is not None and bad_dtype not in ("float32", "bfloat16", "float16"):
        raise PlanError(f"--dtype {bad_dtype!r} is not a compute dtype; use float32, bfloat16 or float16")
    if overrides.get("weight_quantization", "none") not in ("none", "int8", "int4", "native"):
        raise PlanError(f"quantization {overrides['weight_quantization']!r} unknown; use none, int8, int4 or native")
    _check_kv_cache_dtype(overrides.get("kv_cache_dtype"), desc)
    n = _Negotiation(requirements, desc, overrides, quality)
    for step in (
        n.compute_dtype, n.tensor_parallel, n.weight_quantization, n.buffer_alignment, n.kv_cache_dtype, n.kv_block_size,
        n.prefill_chunk_size,
        n.max_batched_tokens, n.kv_cache_budget, n.max_num_seqs, n.graph_capture_sizes, n.step_graph_tokens, n.launch_configs,
        n.max_fused_inputs,
    ):  # fmt: skip
        step()
    return Plan(
        model=requirements.name,
        target=desc.name,
        target_sha256=desc.sha256,
        decisions=tuple(n.out),
        overrides=overrides,
        inputs={"requirements": requirements.to_json(), "descriptor": desc.raw, **({"quality": dict(quality)} if quality else {})},
    )


KV_CACHE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")


def _check_kv_cache_dtype(kv: Any, desc: Descriptor) -> None:
    """An asked-for KV cache dtype the target's kernels can read, or a PlanError saying what to ask for."""
    if kv is None:
        return
    if kv not in KV_CACHE_DTYPES:
        raise PlanError(f"--kv-cache-dtype {kv!r} is not a KV cache dtype; use one of {', '.join(KV_CACHE_DTYPES)}")
    if kv.startswith("float8") and desc.codegen != "torch" and kv not in desc.kv_cache_dtypes:
        raise PlanError(f"--kv-cache-dtype {kv}: the {desc.name} descriptor's paged-attention kernels do not read "
                        f"{kv} caches (its kv_cache.dtypes: {list(desc.kv_cache_dtypes) or 'none'}); use the compute "
                        "dtype, or a descriptor that lists it")


def plan_for_graph(graph: Any, descriptor: Descriptor | str, overrides: Mapping[str, Any] | None = None,
                   rejected: Mapping[str, str] | None = None) -> Plan:
    """Convenience for the compile pipeline: requirements read from a Flat IR Graph; ``rejected``:
    formats the quality gate measured below its thresholds, with the measured reason."""
    from portlayer.flatten.gguf_source import native_summary

    overrides = dict(overrides or {})
    rejected = overrides.pop(GATE_REJECTED, None) or rejected  # passed through run_pipeline's overrides
    quality = {k: v for k, v in (("native", native_summary(graph.meta.get("source"))), ("rejected", dict(rejected or {}))) if v}
    return negotiate(ModelRequirements.from_graph(graph), descriptor, overrides, quality or None)
