"""Cost model: predicted time of one step from the Flat IR, the Plan and the descriptor.

Per kernel group (graph.meta["kernels"], the fuse pass's groups, so what codegen launches):
bytes it moves across its boundary, FLOPs of its nodes, the device curves (cost_model_curves)
and launch cost; summed per step for a decode at (batch, context) or a prefill of N tokens.
Pure: no device, no timing; `portlayer explain --predict` and `portlayer bench` print it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from portlayer.codegen.gemm_rule import merge_refusal
from portlayer.codegen.host_support import decode_splits
from portlayer.codegen.kernels.attention import max_splits
from portlayer.flatten.ir import Graph, Node, TensorType, dtype_itemsize
from portlayer.flatten.ops import get_op
from portlayer.passes.cost_model_curves import Curves

GATHER_TABLE_RATIO = 8  # a parameter 8x larger than the node's output is a table read by index (embedding, rope)
_LAYER = re.compile(r"layers?\.(\d+)\.")


@dataclass(frozen=True)
class GroupTime:
    name: str
    family: str
    layer: str
    us: float
    bytes: int
    flops: int
    bound: str  # memory | compute | launch | attention


@dataclass
class StepPrediction:
    phase: str  # decode | prefill
    batch: int
    context: int
    tokens: int
    ms: float
    groups: list[GroupTime] = field(default_factory=list)
    launches: int = 0
    graphs: bool = False
    host_ms: float = 0.0  # eager launches on an accelerator: host time queuing them (the step is the slower one)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.ms / 1e3) if self.ms > 0 else float("inf")

    def by_family(self) -> dict[str, float]:
        return _sum_by(self.groups, "family")

    def by_layer(self) -> dict[str, float]:
        return _sum_by(self.groups, "layer")


def _sum_by(groups: Sequence[GroupTime], key: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for g in groups:
        out[getattr(g, key)] = out.get(getattr(g, key), 0.0) + g.us / 1e3
    return out


def _layer_of(n: Node) -> str:
    m = _LAYER.search(str(n.meta.get("source", "")) + ".")
    return f"layer {int(m.group(1))}" if m else "other"


def _input_bytes(name: str, graph: Graph, types: Mapping[str, TensorType], out_bytes: int, b: Mapping[str, int],
                 weights: set[str]) -> int:
    t = types.get(name)
    if t is None:
        return 0
    n = t.nbytes(b)
    if name in graph.params and name not in weights and n > GATHER_TABLE_RATIO * max(out_bytes, 1):
        return out_bytes  # rows gathered from a table (embedding, rope cache), not the whole table
    return n


def _group_traffic(rec: Mapping[str, Any], nodes: list[Node], graph: Graph, types: Mapping[str, TensorType],
                   b: Mapping[str, int]) -> tuple[int, int]:
    out_bytes = sum(types[o].nbytes(b) for o in rec.get("outputs", []) if o in types)
    weights = {i for n in nodes if n.op in ("linear", "matmul", "linear_wq") for i in n.inputs[1:] if i}  # read whole
    in_bytes = sum(_input_bytes(i, graph, types, out_bytes, b, weights) for i in rec.get("inputs", []) if i)
    flops = 0
    for n in nodes:
        ins = [types.get(i) if i is not None else None for i in n.inputs]
        flops += get_op(n.op).cost(ins, [v.type for v in n.outputs], n.attrs, b).flops
    return in_bytes + out_bytes, flops


def _gemms(nodes: list[Node], types: Mapping[str, TensorType], b: Mapping[str, int]) -> list[tuple[int, int, int]]:
    """(M, K, N) of every GEMM of the group, in graph order (siblings Q|K|V, a joint gate|up: several)."""
    out = []
    for n in nodes:
        if n.op in ("linear", "matmul", "linear_wq") and len(n.inputs) > 1 and n.inputs[1] in types:
            w = types[n.inputs[1]]
            if n.op == "linear_wq":  # packed integer weight [N, K * bits / 8]: K from the activation
                nn, k = int(w.shape[0]), int(types[n.inputs[0]].shape[-1])
            elif n.op == "linear":
                nn, k = int(w.shape[0]), int(w.shape[-1])
            else:
                k, nn = int(w.shape[-2]), int(w.shape[-1])
            out.append((max(1, n.outputs[0].type.numel(b) // max(nn, 1)), k, nn))
    return out


def _attention(nodes: list[Node], types: Mapping[str, TensorType], phase: str, batch: int, context: int,
               tokens: int, cache_dtype: str | None = None) -> tuple[int, int, str, int] | None:
    """(KV bytes read, FLOPs, cache dtype, float32 score bytes a torch-op implementation materialises);
    ``cache_dtype``: the Plan's kv_cache_dtype (default the K/V values' own)."""
    for n in nodes:
        if n.op != "attention":
            continue
        k, v = types[n.inputs[1]], types[n.inputs[2]]
        hq, hkv = int(n.attrs.get("num_heads", 1)), int(k.shape[1])
        dk, dv = int(k.shape[2]), int(v.shape[2])
        item = dtype_itemsize(cache_dtype or k.dtype)
        if phase == "decode":
            kv = batch * (context + 1) * hkv * (dk + dv) * item
            flops = 2 * batch * (context + 1) * hq * (dk + dv)
            scores = batch * hq * (context + 1) * 4
        else:
            kv = 2 * tokens * hkv * (dk + dv) * item  # written once, read back by the kernel
            span = (tokens + 1) / 2 if n.attrs.get("causal", True) else tokens
            flops = int(2 * tokens * span * hq * (dk + dv))
            scores = hq * tokens * tokens * 4
        return kv, flops, k.dtype, scores
    return None


def predict(graph: Graph, plan: Any, descriptor: Mapping[str, Any], phase: str = "decode", batch: int = 1,
            context: int = 128, tokens: int | None = None) -> StepPrediction:
    """Predicted time of one step. ``phase`` decode: ``batch`` sequences of one new token over ``context``
    cached ones; prefill: one sequence of ``tokens`` new tokens (``batch`` ignored)."""
    kernels = graph.meta.get("kernels")
    if not kernels:
        raise ValueError("cost model: the graph has no kernel groups (graph.meta['kernels']); run the pass pipeline first")
    curves = Curves.from_descriptor(descriptor)
    if phase == "decode":
        b = {"num_tokens": batch, "num_seqs": batch}
        new_tokens = batch
    elif phase == "prefill":
        new_tokens = int(tokens or 128)
        # a step graph (Plan step_graph_tokens, codegen/step_graphs.py) computes the tokens padded to its bucket
        buckets = [int(s) for s in (_plan_value(plan, "step_graph_tokens", []) or []) if int(s) >= new_tokens]
        padded = min(buckets) if buckets and descriptor.get("codegen") != "torch" else new_tokens
        b, batch, context = {"num_tokens": padded, "num_seqs": 1}, 1, 0
    else:
        raise ValueError(f"cost model: phase {phase!r} is not decode or prefill")
    sym = graph.meta.get("token_symbol", "num_tokens")
    b[sym] = b["num_tokens"]
    types = graph.value_types()
    by_name = {n.name: n for n in graph.nodes}
    dtype = str(_plan_value(plan, "compute_dtype", "float32"))
    kv_dtype = _plan_value(plan, "kv_cache_dtype", None)
    torch_family = descriptor.get("codegen") == "torch"
    sizes = _plan_value(plan, "graph_capture_sizes", []) or []
    if phase == "decode":
        graphs = not torch_family and any(int(s) >= batch for s in sizes)
    else:  # a prefill of up to the largest step-graph bucket replays a graph too
        graphs = not torch_family and bool(buckets)
    per_launch = (curves.graph_launch_us if curves.graph_launch_us is not None else 1.0) if graphs else curves.launch_us
    if torch_family and curves.node_us:  # the host program calls each node's implementation: its measured cost
        per_launch = curves.node_us
    step_host_us = 0.0
    eager_generated = not torch_family and not graphs and bool(curves.generated_launch_us)
    if eager_generated:  # eager generated kernels
        per_launch = curves.generated_launch_us
        if curves.generated_kernel_us:  # one step's fixed host cost, then each kernel's
            per_launch = min(curves.generated_kernel_us, curves.generated_launch_us)
            step_host_us = curves.generated_launch_us - per_launch
    groups, launches, host_us = [], 0, step_host_us
    per_node = torch_family and bool(curves.torch_nodes)  # calibrated per op through host_support.ref
    prev_bytes = 0  # what the group before moved: past the cache knee, this one starts cold
    for rec in kernels:
        members = [by_name[n] for n in rec["nodes"] if n in by_name]
        compute = [n for n in members if get_op(n.op).kind != "view"]
        if not compute:
            continue
        nbytes, flops = _group_traffic(rec, compute, graph, types, b)
        n_launch = len(compute) if torch_family or rec.get("family") == "torch" else 1
        launches += n_launch
        attn = _attention(compute, types, phase, batch, context, new_tokens, kv_dtype)
        gemms = _gemms(compute, types, b)
        launch_us = n_launch * per_launch
        if attn is not None:
            kv, aflops, kv_dtype, scores = attn
            work = max(kv, scores) if torch_family else kv  # torch ops write the [heads, q, k] scores; a fused kernel does not
            dev_us = curves.attention_us(batch, work, aflops, dtype, torch_family,
                                         cold=per_node and curves.sweeps_caches(prev_bytes), decode=phase == "decode")
            if per_node and curves.batched_attention():  # the fit timed the whole call the program makes
                launch_us = 0.0
            else:
                dev_us += curves.memory_us(nbytes)
            nbytes, flops, bound = nbytes + kv, flops + aflops, "attention"
            if phase == "decode" and rec.get("impl") == "triton.paged_attention" and _decode_splits(
                    compute, types, plan, descriptor, batch) > 1:
                # split-K decode attention: a second kernel (the reduce) merges the partial results; a calibrated
                # generated-attention fit timed both kernels already (device time)
                if not curves.generated_attention:
                    part = curves.memory_us(2 * new_tokens * _heads(compute) * 4)
                    dev_us += max(part, per_launch) if graphs else part
                launches += 1
                host_us += per_launch
        elif gemms:
            biggest = max(types[n.inputs[1]].nbytes({}) for n in compute
                          if n.op in ("linear", "linear_wq", "matmul") and len(n.inputs) > 1 and n.inputs[1] in types)
            path = _gemm_path(descriptor, rec, gemms[0][0], torch_family, biggest)
            linears = [n for n in compute if get_op(n.op).kind == "gemm"]
            merged = (path == "vendor" and not torch_family and rec.get("impl") == "triton.gemm" and len(linears) > 1
                      and not merge_refusal(linears, types, graph.params))
            if path == "gemv":  # one few-rows launch reads every linear's weight (siblings / joint: N side by side)
                m, k, _ = gemms[0]
                # above gemv_max_tokens the tensor-core tier runs: its own calibrated timings where measured
                tier = "gemv_dot" if m > int((descriptor.get("tuning") or {}).get("gemv_max_tokens", 0)) else "gemv"
                dev_us = curves.gemm_us(m, k, sum(g[2] for g in gemms), flops=flops, nbytes=nbytes, dtype=dtype, path=tier)
            elif merged:  # one vendor GEMM on the concatenated weights (codegen/kernels/gemm_merged.py)
                m, k, _ = gemms[0]
                dev_us = curves.gemm_us(m, k, sum(g[2] for g in gemms), flops=flops, nbytes=nbytes, dtype=dtype, path=path)
                if not rec.get("epilogue"):  # siblings whose outputs leave: one launch copies the columns apart
                    t = curves.memory_us(2 * sum(types[n.outputs[0].name].nbytes(b) for n in linears))
                    dev_us += max(t, per_launch) if graphs else t
                    launches += 1
                    host_us += per_launch
            else:  # each linear is its own GEMM launch (codegen/kernels/gemm_group.py above the rows rule)
                kn = sum(g[1] * g[2] for g in gemms)
                times = [curves.gemm_us(*g, flops=flops * g[1] * g[2] / kn, nbytes=nbytes * g[1] * g[2] / kn,
                                        dtype=dtype, path=path) for g in gemms]
                dev_us = times[0] + sum(max(t, per_launch) if graphs else t for t in times[1:])
                if not torch_family:  # the torch family counted every node above
                    launches += len(gemms) - 1
                    launch_us = (n_launch + len(gemms) - 1) * per_launch  # a program line each: launch, views
            if path == "vendor" and eager_generated:  # the host dispatches a torch op per vendor GEMM, not a
                # generated kernel's launch: priced at the calibrated eager torch-op launch
                launch_us = (1 if merged else len(gemms)) * curves.launch_us
            for part in ([] if torch_family else _unfused_parts(rec, by_name, types, b, path)):
                # what the GEMM path at these rows cannot absorb runs as its own kernel (codegen/kernels/gemm_group.py)
                t = curves.memory_us(part)
                dev_us += max(t, per_launch) if graphs else t
                launches += 1
                host_us += per_launch
            bound = "compute" if flops / (curves.peak_tflops(dtype) * 1e6) > nbytes / (curves.bandwidth_gbps * 1e3) else "memory"
            if per_node:  # the GEMM curve was timed through the linear op's reference call: its host cost included
                launch_us = 0.0
        elif per_node:  # each node: its op's calibrated call, the first carrying the group's bytes
            cold = curves.sweeps_caches(prev_bytes)
            dev_us = sum(curves.torch_node_us(n.op, get_op(n.op).kind, nbytes if i == 0 else 0.0, cold and i == 0)
                         for i, n in enumerate(compute))
            launch_us, bound = 0.0, "launch"
        else:
            dev_us, bound = curves.memory_us(nbytes), "memory"
        host_us += launch_us
        us = dev_us + launch_us if torch_family else (max(dev_us, per_launch) if graphs else dev_us)
        if dev_us < per_launch:
            bound = "launch"
        groups.append(GroupTime(rec["name"], rec.get("family", "?"), _layer_of(compute[0]), us, nbytes, flops, bound))
        prev_bytes = nbytes
    if per_node and curves.torch_step_us:  # run(): the step state, once
        groups.append(GroupTime("step", "host", "other", curves.torch_step_us, 0, 0, "launch"))
    device_us = sum(g.us for g in groups)
    if torch_family:  # the host runs every op itself: times add
        total = device_us
    elif graphs:  # one replay: the kernels back to back, none faster than an in-graph tiny kernel (floored above),
        # then what the host adds to a step that is waited for (static copies, replay call, output copy)
        layers = sum(1 for n in graph.nodes if get_op(n.op).kind == "attention")  # KV-cache layers (MLA too)
        step = curves.graph_step_us(batch, layers)
        if step:  # the outputs are copied out of the graph's static buffers (read + write); each input the
            # calibrated program did not have (or had and this graph lacks) is one copy call more (or less)
            step += curves.memory_us(2 * sum(types[o].nbytes(b) for o in graph.outputs if o in types))
            step = max(0.0, step + (len(graph.inputs) - curves.graph_step_inputs) * curves.launch_us)
        step += launches * curves.graph_node_us  # submitting the graph's nodes: not hidden when the step is waited for
        if step:
            groups.append(GroupTime("step", "host", "other", step, 0, 0, "launch"))
        total = device_us + step
    else:  # eager: the host queues launches while the device runs; the slower of the two sets the pace
        total = max(device_us, host_us)
    host = host_us / 1e3 if not (torch_family or graphs) else 0.0
    return StepPrediction(phase, batch, context, new_tokens, total / 1e3, groups, launches, graphs, host)


def _heads(nodes: list[Node]) -> int:
    """Query heads x head dim of the group's attention node (the width of one token's attention output)."""
    for n in nodes:
        if n.op == "attention":
            return int(n.attrs.get("num_heads", 1)) * int(n.outputs[0].type.shape[-1])
    return 0


def _unfused_parts(rec: Mapping[str, Any], by_name: Mapping[str, Node], types: Mapping[str, TensorType],
                   b: Mapping[str, int], path: str) -> list[int]:
    """Bytes of each kernel a GEMM group's fused neighbours become on this path: the norm prologue is
    computed inside the few-rows kernel only (elsewhere it is its own reduction kernel), and the epilogue
    (an activation, a product) runs inside a generated GEMM but after the vendor GEMM as its own pointwise
    kernel. Each part moves its inputs from outside it and its outputs."""
    parts = []
    for key, absorbed in (("prologue", path == "gemv"), ("epilogue", path != "vendor")):
        names = [n for n in rec.get(key) or [] if n in by_name]
        if absorbed or not names:
            continue
        inside = {o.name for n in names for o in by_name[n].outputs}
        ins = {i for n in names for i in by_name[n].inputs if i and i not in inside and i in types}
        parts.append(sum(types[i].nbytes(b) for i in ins) + sum(types[o].nbytes(b) for o in inside if o in types))
    return parts


def _gemm_path(descriptor: Mapping[str, Any], rec: Mapping[str, Any], m: int, torch_family: bool,
               weight_bytes: int = 0) -> str:
    """Which GEMM codegen runs at M rows (codegen/gemm_rule.py's thresholds from the descriptor; a weight over
    tuning.gemv_max_weight_mib keeps the vendor GEMM at every row count, codegen/kernels/gemm_group.py).
    "gemv" covers both few-rows tiers (CUDA cores up to gemv_max_tokens, tensor cores up to
    gemv_dot_max_tokens): one launch per fused group, priced as the few-rows path at M rows."""
    impl = rec.get("impl")
    if torch_family or impl not in ("triton.gemm", "triton.gemm_wq"):
        return "vendor"
    tuning = descriptor.get("tuning") or {}
    cap = float(tuning.get("gemv_max_weight_mib", 0)) * 2**20
    few_rows = max(int(tuning.get("gemv_max_tokens", 0)), int(tuning.get("gemv_dot_max_tokens", 0)))
    if m <= few_rows and (cap <= 0 or weight_bytes <= cap):
        return "gemv"
    if impl == "triton.gemm_wq":  # weight-only quantized: generated, or dequantize + vendor from wq_vendor_min_tokens
        start = int(tuning.get("wq_vendor_min_tokens", 0))
        return "vendor" if 0 < start <= m else "triton"
    return "triton" if m <= int(tuning.get("triton_gemm_max_tokens", 0)) else "vendor"


def _decode_splits(nodes: list[Node], types: Mapping[str, TensorType], plan: Any, descriptor: Mapping[str, Any],
                   batch: int) -> int:
    """The KV splits the generated decode attention takes at this batch (the host's rule, on the Plan's
    launch.attention_decode): one split runs no reduce kernel."""
    cfg = _plan_value(plan, "launch.attention_decode", None) or {}
    node = next((n for n in nodes if n.op == "attention"), None)
    if node is None or "PROGRAMS" not in cfg:
        return 2  # a program of another generation: it always reduced
    hkv = int(types[node.inputs[1]].shape[1])
    cu = int((descriptor.get("compute_units") or {}).get("count") or 1)
    return decode_splits(batch, hkv, int(cfg["PROGRAMS"]) * cu, max_splits(cu, hkv))


def _plan_value(plan: Any, name: str, default: Any) -> Any:
    try:
        return plan.value(name)
    except (KeyError, AttributeError):
        return default


def predict_steps(graph: Graph, plan: Any, descriptor: Mapping[str, Any], batches: Sequence[int] = (1, 16, 64),
                  context: int = 128, prefill_tokens: int = 128) -> list[StepPrediction]:
    """The standard set: decode at each batch, then one prefill."""
    out = [predict(graph, plan, descriptor, "decode", b, context) for b in batches]
    out.append(predict(graph, plan, descriptor, "prefill", tokens=prefill_tokens))
    return out


def format_predictions(preds: Sequence[StepPrediction], detail: bool = True) -> str:
    """ms/step and tok/s per step, then (for the first decode and the prefill) per family and per layer."""
    lines = ["predicted (cost model; docs/capabilities.md):"]
    for p in preds:
        what = f"decode   batch {p.batch:>3}" if p.phase == "decode" else f"prefill {p.tokens:>5} tok"
        ctx = f"  (context {p.context})" if p.phase == "decode" else ""
        mode = ", graph replay" if p.graphs else (", host-bound (launches)" if p.host_ms >= p.ms > 0 else "")
        lines.append(f"  {what}  {p.ms:9.3f} ms/step {p.tokens_per_s:11.1f} tok/s  {p.launches} launches{mode}{ctx}")
    if detail:
        for p in [q for q in preds if q.phase == "decode"][:1] + [q for q in preds if q.phase == "prefill"][:1]:
            head = f"decode batch {p.batch}" if p.phase == "decode" else f"prefill {p.tokens}"
            fam = ", ".join(f"{k} {v:.3g}" for k, v in sorted(p.by_family().items(), key=lambda kv: -kv[1]))
            lines.append(f"  {head} per family (ms{', device time' if p.host_ms >= p.ms > 0 else ''}): {fam}")
            layers = p.by_layer()
            per = [v for k, v in layers.items() if k != "other"]
            if per:
                lines.append(f"  {head} per layer (ms): {len(per)} layers, {min(per):.3g}..{max(per):.3g} each; "
                             f"outside layers {layers.get('other', 0.0):.3g}")
    return "\n".join(lines)
