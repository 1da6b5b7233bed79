"""When the Triton GEMM runs instead of the vendor GEMM (cuBLAS / hipBLASLt via torch.mm).

The rule is a token-count threshold per device: at or below it the Triton GEMM (with its
fused epilogue) runs, above it the vendor GEMM. The threshold is descriptor data,
``tuning.triton_gemm_max_tokens``, with its measurement named in the descriptor's
``sources`` (benchmarks/bench_kernels.py, docs/gpu.md); a descriptor without it gets 0,
i.e. the vendor GEMM, which is the safe default for a device nobody measured.

Below both, ``tuning.gemv_max_tokens``: at or below it (decode) the few-rows kernel
(templates/triton/gemv.py.j2) runs, which reads the weight once on the CUDA cores instead of
padding the rows to a tensor-core tile; weight-only quantized linears use it too. Weights above
``tuning.gemv_max_weight_mib`` (a vocabulary projection, say) keep the vendor GEMM at every row
count: where one launch streams hundreds of megabytes, cuBLAS's GEMV reads faster.

Weight-only quantized linears (``linear_wq``) above the few-rows rule: from
``tuning.wq_vendor_min_tokens`` rows the weight is dequantized into a temporary (one launch) and the
vendor GEMM runs on it; below it (or without the field) the Triton weight-only GEMM.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from portlayer.flatten.ir import dtype_itemsize


def _tuning(descriptor: Any, key: str) -> float:
    return float((getattr(descriptor, "tuning", None) or {}).get(key, 0))


def gemv_max_tokens(descriptor: Any) -> int:
    """The descriptor's measured few-rows crossover ($.tuning.gemv_max_tokens), else 0 (never)."""
    return int(_tuning(descriptor, "gemv_max_tokens"))


def gemv_dot_max_tokens(descriptor: Any) -> int:
    """Rows up to which the tensor-core tier of the few-rows kernels runs, above gemv_max_tokens
    ($.tuning.gemv_dot_max_tokens), else 0 (no tier). A value at or below gemv_max_tokens adds nothing."""
    return int(_tuning(descriptor, "gemv_dot_max_tokens"))


def few_rows_limit(descriptor: Any) -> int:
    """The most rows any few-rows kernel (CUDA-core or tensor-core tier) takes: where fusing a norm
    prologue or a joint epilogue into one launch pays off (passes/fuse.py, the cost model)."""
    return max(gemv_max_tokens(descriptor), gemv_dot_max_tokens(descriptor))


def gemv_max_weight_bytes(descriptor: Any) -> int:
    """The largest weight the few-rows kernel takes ($.tuning.gemv_max_weight_mib), else 0 (any)."""
    return int(_tuning(descriptor, "gemv_max_weight_mib") * 2**20)


def triton_gemm_max_tokens(descriptor: Any) -> int:
    """The descriptor's measured crossover ($.tuning.triton_gemm_max_tokens), else 0."""
    return int(_tuning(descriptor, "triton_gemm_max_tokens"))


def wq_vendor_min_tokens(descriptor: Any) -> int:
    """Rows from which a weight-only quantized linear dequantizes its weight into a temporary and runs the
    vendor GEMM ($.tuning.wq_vendor_min_tokens), else 0: never (the Triton weight-only GEMM at every row count)."""
    return int(_tuning(descriptor, "wq_vendor_min_tokens"))


#: Byte alignment every part of a merged weight (and bias) keeps inside the concatenation: the few-rows
#: kernels read each part through its own pointer, and Triton specializes pointers on 16-byte alignment.
MERGE_ALIGN = 16


def merge_refusal(linears: Sequence[Any], types: Mapping[str, Any], params: Collection[str]) -> str:
    """Why projections of one input cannot run above the few-rows rule as ONE vendor GEMM on their weights
    concatenated along N ('' when they can). They can when they are plain linears of one input whose weights
    (and biases, all or none) are parameters of one dtype and K, and each part's rows start 16-byte aligned in
    the concatenation (each stays a row-slice view for the kernels that read it alone).

    Why: at 16-64 rows (batched decode) and in prefill each vendor GEMM costs a launch and a fixed 3-5 us on a
    2-6 MB weight (docs/performance.md, session 8); Q|K|V as one GEMM and gate|up as one are what vLLM's
    QKVParallelLinear / MergedColumnParallelLinear do."""
    if len(linears) < 2:
        return "one linear: nothing to merge"
    x = linears[0].inputs[0]
    w0 = types[linears[0].inputs[1]] if len(linears[0].inputs) > 1 and linears[0].inputs[1] in types else None
    has_bias = [len(n.inputs) > 2 and n.inputs[2] is not None for n in linears]
    if any(has_bias) and not all(has_bias):
        return "some projections have a bias and some do not"
    offset = 0
    for n in linears:
        if n.op != "linear":
            return f"{n.name} is {n.op}: only plain linears merge (a quantized weight is dequantized per linear)"
        if n.inputs[0] != x:
            return f"{n.name} reads {n.inputs[0]}, not {x}"
        w = n.inputs[1]
        if w not in params or w not in types:
            return f"{n.name}'s weight {w} is not a parameter"
        t = types[w]
        if w0 is None or t.rank != 2 or t.dtype != w0.dtype or t.shape[1] != w0.shape[1] or not isinstance(t.shape[0], int):
            return f"{n.name}'s weight {t} differs in dtype or K from {w0}, or is not [N, K]"
        if (offset * int(t.shape[1]) * dtype_itemsize(t.dtype)) % MERGE_ALIGN:
            return f"{n.name}'s rows would start at a byte offset not {MERGE_ALIGN}-aligned in the concatenation"
        if has_bias[0]:
            b = n.inputs[2]
            if b not in params or b not in types or types[b].dtype != types[linears[0].inputs[2]].dtype:
                return f"{n.name}'s bias {b} is not a parameter of the first bias's dtype"
            if (offset * dtype_itemsize(types[b].dtype)) % MERGE_ALIGN:
                return f"{n.name}'s bias would start at a byte offset not {MERGE_ALIGN}-aligned"
        offset += int(t.shape[0])
    return ""


def merged_name(weights: Sequence[str]) -> str:
    """The load-time concatenation of ``weights`` (named after the first, so per-layer names fold into one
    method: model_layers_3_..._q_proj_weight_cat3)."""
    return f"{weights[0]}_cat{len(weights)}"
