"""The CANN op-call host program: kernel groups -> readable Python calling torch_npu (Ascend).

Every kernel group of the fuse pass becomes one statement (or a short block) in execution
order, calling the torch_npu API the ``select`` pass recorded, with the names and signatures
of ../shared/reference/ascend-ops.md (section cited in the generated comments):

- rms_norm -> ``npu.npu_rms_norm(x, gamma, eps)[0]``; residual add + rms_norm ->
  ``y, _, x_sum = npu.npu_add_rms_norm(x1, x2, gamma, eps)`` (§1, §2);
- q/k rope pair -> ``npu.npu_mrope(...)`` or ``npu._npu_rotary_embedding(...)`` (in place), the
  ``[max_pos, rot]`` cos-first table converted to the activation dtype ONCE at load (§3);
- silu(gate) * up -> ``npu.npu_swiglu(gate_up)``: separate gate/up projections get their two
  weights concatenated at load into one GEMM whose first half is the gate (§4);
- linear -> ``torch.nn.functional.linear(x, W[out, in], b)``;
- attention -> a per-configuration method: KV write (``npu_scatter_pa_kv_cache(...,
  cache_mode="Norm")`` or ``_npu_reshape_and_cache`` with int32 slots, §5), decode through
  ``_npu_paged_attention`` (host int32 context_lens, §6), prefill / mixed steps through
  ``npu_fused_infer_attention_score`` in TND with cumulative lengths, the block table and
  sparse_mode=3 + the 2048x2048 int8 triu mask (sparse_mode=0 when bidirectional, §7);
- anything else: the op's reference implementation (torch), recorded in ``fallbacks``.

``npu`` is the torch_npu module on an Ascend machine, or the CPU emulator
(backends/ascend_emulator.py) everywhere else. This file also holds :class:`CannHostProgram`,
the base class the generated program derives from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from portlayer.codegen.host_support import HostProgram
from portlayer.codegen.kernels.context import GenContext, host_dim
from portlayer.codegen.kernels.fallback import py_literal
from portlayer.codegen.lowering import GroupCode, KernelGroup
from portlayer.flatten.ir import Graph, Node
from portlayer.flatten.op_defs.attention import attention_reference, read_kv_cache

ROPE_MODE = {"neox": "half", "gptj": "interleave"}


@dataclass
class CannState:
    """Program-wide state of CANN codegen: load-time conversions, attention methods, calls used.
    The lowerings in backends/impls_cann.py write through it; ``template_vars`` feeds the template."""

    graph: Graph
    plan: Any = None
    lines: list[str] = field(default_factory=list)
    prepare: list[str] = field(default_factory=list)  # load-time weight conversions (W.* names)
    attn_methods: list[dict[str, Any]] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    skip: set[str] = field(default_factory=set)  # nodes realised by a call emitted elsewhere
    swiglu: dict[str, tuple[str, str]] = field(default_factory=dict)  # gate linear -> (merged weight, gate_up value)
    swiglu_mul: dict[str, str] = field(default_factory=dict)  # mul node -> gate_up value

    def __post_init__(self) -> None:
        self.nodes = {n.name: n for n in self.graph.nodes}
        self.types = self.graph.value_types()
        self.prod = self.graph.producers()
        self.users = self.graph.users()
        self.params = set(self.graph.params)
        _plan_swiglu(self)

    def template_vars(self) -> dict[str, Any]:
        block = 128
        if self.plan is not None:
            try:
                block = int(self.plan.value("kv_block_size") or block)
            except (KeyError, TypeError, ValueError):
                pass
        return {"prepare": self.prepare, "attn": self.attn_methods, "calls": self.calls, "block_size": block}

    def emit(self, line: str) -> None:
        self.lines.append(line)

    def call(self, name: str) -> None:
        if name not in self.calls:
            self.calls.append(name)

    def w(self, value: str | None) -> str:
        return "None" if value is None else value


def _shape(t: Any) -> str:
    return ", ".join(host_dim(d) for d in t.shape)


# ---- gate/up -> one GEMM + npu_swiglu ------------------------------------------------------------


def _plan_swiglu(g: CannState) -> None:
    """Find silu(linear(x, Wg)) * linear(x, Wu) with private intermediates and no bias: at load,
    W_gate_up = cat(Wg, Wu) (gate first, as npu_swiglu wants); in the step, one F.linear + npu_swiglu."""
    for mul in g.graph.nodes:
        if mul.op != "mul" or mul.meta.get("impl") != "cann.elementwise" or len(mul.inputs) != 2 or None in mul.inputs:
            continue
        for gi in (0, 1):
            silu, up = g.prod.get(mul.inputs[gi]), g.prod.get(mul.inputs[1 - gi])
            if silu is None or silu.op != "silu" or up is None or up.op != "linear":
                continue
            gate = g.prod.get(silu.inputs[0])
            if gate is None or gate.op != "linear":
                continue
            private = (len(g.users.get(gate.outputs[0].name, [])) == 1 and len(g.users.get(silu.outputs[0].name, [])) == 1
                       and len(g.users.get(up.outputs[0].name, [])) == 1)
            same = (gate.inputs[0] == up.inputs[0] and gate.inputs[1] in g.params and up.inputs[1] in g.params
                    and (len(gate.inputs) < 3 or gate.inputs[2] is None) and (len(up.inputs) < 3 or up.inputs[2] is None)
                    and gate.meta.get("impl") == up.meta.get("impl") == "cann.linear"
                    and silu.meta.get("impl") == "cann.elementwise")
            if not (private and same):
                continue
            merged = f"{gate.inputs[1]}_gate_up"
            value = f"{gate.outputs[0].name}_gate_up"
            g.prepare.append(f"W.{merged} = torch.cat([W.{gate.inputs[1]}, W.{up.inputs[1]}], dim=0).contiguous()  "
                             "# gate rows first: npu_swiglu activates the first half")
            g.prepare.append(f"del W.{gate.inputs[1]}, W.{up.inputs[1]}")
            g.swiglu[gate.name] = (merged, value)
            g.swiglu_mul[mul.name] = value
            g.skip |= {silu.name, up.name}
            break


# ---- per node ---------------------------------------------------------------------------------


def _ref(g: CannState, n: Node, reason: str, group: str) -> None:
    ins = ", ".join(g.w(i) for i in n.inputs)
    outs = ", ".join(v.name for v in n.outputs)
    g.emit(f"{outs}, = ref({n.op!r}, [{ins}], {py_literal(n.attrs)}, st)  # reference op (torch): {reason}")
    g.fallbacks.append((group, f"{n.name} ({n.op}): {reason}"))


def _refused(n: Node) -> str:
    r = [x for x in n.meta.get("refused") or [] if x["impl"].startswith("cann.")]
    return "; ".join(f"{x['impl']}: {x['reason']}" for x in r) or "no CANN call selected"


def _gamma(g: CannState, n: Node) -> str:
    w = n.inputs[1]
    off = n.attrs.get("weight_offset") or 0.0
    if not off:
        return w
    name = f"{w}_plus_offset"
    line = f"W.{name} = W.{w} + {off!r}  # (offset + weight), as Gemma's vllm-ascend path passes 1.0 + weight"
    if line not in g.prepare:
        g.prepare.append(line)
    return f"W.{name}"


def _rope_table(g: CannState, table: str, dtype: str) -> str:
    name = f"{table}_{dtype}"
    line = (f"W.{name} = W.{table}.to(torch.{dtype}).contiguous()  # [max_pos, rot], cos half first: "
            "converted once at load")
    if line not in g.prepare:
        g.prepare.append(line)
    return f"W.{name}"


def cann_lowering(emit: Any) -> Any:
    """A lowering from a per-node emitter: the group's nodes in order, absorbed nodes skipped
    (the vendor call of their root realises them)."""
    def lower(ctx: GenContext, group: KernelGroup) -> GroupCode:
        g: CannState = ctx.cann  # type: ignore[attr-defined]
        g.lines = []
        for n in group.nodes:
            if n.name in g.skip or n.meta.get("fused_into"):
                continue
            emit(g, n, group)
        return GroupCode([], list(g.lines), [])

    lower.__name__ = lower.__qualname__ = f"lower_{emit.__name__}"
    lower.__doc__ = emit.__doc__
    return lower


def emit_elementwise(g: CannState, n: Node, group: KernelGroup) -> None:
    """aclnn elementwise through torch; the mul of a planned gate|up pair becomes npu_swiglu (§4)."""
    if n.name in g.swiglu_mul:
        g.call("npu_swiglu")
        g.emit(f"{n.outputs[0].name} = npu.npu_swiglu({g.swiglu_mul[n.name]}, dim=-1)  # silu(gate) * up, gate = first half (§4)")
    else:
        _ref(g, n, f"{n.meta.get('impl')}: a torch op (aclnn on the NPU)", group.name)


def emit_torch_op(g: CannState, n: Node, group: KernelGroup) -> None:
    """A torch op on the NPU (aclnn reductions and the like)."""
    _ref(g, n, f"{n.meta.get('impl')}: a torch op (aclnn on the NPU)", group.name)


def emit_not_generated(g: CannState, n: Node, group: KernelGroup) -> None:
    """A registered vendor call this generator does not emit yet: the reference op, said loudly."""
    _ref(g, n, f"{n.meta.get('impl')}: no CANN call generated for it yet ({_refused(n)})", group.name)


def emit_linear(g: CannState, n: Node, group: KernelGroup) -> None:
    """torch.nn.functional.linear(x, W[out, in], b); the gate of a gate|up pair runs both at once."""
    out = n.outputs[0].name
    if n.name in g.swiglu:
        merged, value = g.swiglu[n.name]
        g.emit(f"{value} = F.linear({n.inputs[0]}, W.{merged})  # gate|up in one GEMM (weights concatenated at load)")
    elif n.op == "linear":
        b = g.w(n.inputs[2] if len(n.inputs) > 2 else None)
        g.emit(f"{out} = F.linear({n.inputs[0]}, {n.inputs[1]}, {b})")
    else:
        g.emit(f"{out} = torch.matmul({n.inputs[0]}, {n.inputs[1]})")


def emit_rms_norm(g: CannState, n: Node, group: KernelGroup) -> None:
    """npu_rms_norm(x, gamma, eps) -> (y, rstd) (§1)."""
    g.call("npu_rms_norm")
    g.emit(f"{n.outputs[0].name}, _ = npu.npu_rms_norm({n.inputs[0]}, {_gamma(g, n)}, {n.attrs.get('eps', 1e-6)!r})  # (y, rstd) §1")
    want, x = n.outputs[0].type.dtype, g.types[n.inputs[0]].dtype
    if want != x:  # the call returns x's dtype; the IR promotes with gamma's (a float32 gamma on bf16 x)
        g.emit(f"{n.outputs[0].name} = {n.outputs[0].name}.to(torch.{want})")


def emit_add_rms_norm(g: CannState, n: Node, group: KernelGroup) -> None:
    """npu_add_rms_norm(x1, x2, gamma, eps) -> (y, rstd, x1 + x2) (§2)."""
    g.call("npu_add_rms_norm")
    add = g.nodes[n.meta["absorbs"][0]]
    s = add.outputs[0].name
    keep = s in group.outputs or s in g.graph.outputs or any(u.name not in group.node_names for u in g.users.get(s, []))
    g.emit(f"{n.outputs[0].name}, _, {s if keep else '_'} = npu.npu_add_rms_norm({add.inputs[0]}, {add.inputs[1]}, "
           f"{_gamma(g, n)}, {n.attrs.get('eps', 1e-6)!r})  # (y, rstd, x1 + x2) §2")


def emit_rope(g: CannState, n: Node, group: KernelGroup) -> None:
    """The q/k pair in one call (npu_mrope, or _npu_rotary_embedding in place) (§3)."""
    if n.meta.get("absorbs"):
        _rope(g, n, n.meta["impl"])
    else:
        emit_not_generated(g, n, group)


def emit_swiglu(g: CannState, n: Node, group: KernelGroup) -> None:
    """npu_swiglu(gate_up, dim=-1) on the two halves of one tensor (§4)."""
    silu = g.nodes[n.meta["absorbs"][0]]
    src = g.prod[silu.inputs[0]].inputs[0]
    g.call("npu_swiglu")
    g.emit(f"{n.outputs[0].name} = npu.npu_swiglu({src}, dim=-1)  # gate = first half (§4)")


def _rope(g: CannState, n: Node, impl: str) -> None:
    """The q/k pair in one call; ``n`` is the k rope (the root), its partner the q rope."""
    qn = g.nodes[n.meta["absorbs"][0]]
    kn = n
    qt, kt = qn.outputs[0].type, kn.outputs[0].type
    d = int(n.attrs.get("head_dim") or kt.shape[-1])
    style = n.attrs.get("style", "neox")
    table = _rope_table(g, n.inputs[2], qt.dtype)
    pos = n.inputs[1]
    if impl == "cann.npu_mrope":
        g.call("npu_mrope")
        g.emit(f"_q, _k = npu.npu_mrope({pos}, {qn.inputs[0]}.reshape(T, -1), {kn.inputs[0]}.reshape(T, -1), {table}, {d}, "
               f"mrope_section=[0, 0, 0], rotary_mode={ROPE_MODE[style]!r})  # §3, new tensors")
    else:
        g.call("_npu_rotary_embedding")
        copies = []
        for x in (qn.inputs[0], kn.inputs[0]):  # in place: copy an input someone else still reads
            copies.append(".clone()" if len(g.users.get(x, [])) > 1 else "")
        g.emit(f"_q, _k = {qn.inputs[0]}.reshape(T, -1){copies[0]}, {kn.inputs[0]}.reshape(T, -1){copies[1]}")
        g.emit(f"npu._npu_rotary_embedding({pos}, _q, _k, {d}, {table}, {style == 'neox'})  # §3, in place on [T, N*D]")
    g.emit(f"{qn.outputs[0].name}, {kn.outputs[0].name} = _q.view({_shape(qt)}), _k.view({_shape(kt)})")


def emit_attention(g: CannState, n: Node, group: KernelGroup, pa_ok: bool, pa_why: str) -> None:
    """KV write + _npu_paged_attention for decode (when ``pa_ok``) + npu_fused_infer_attention_score (§5-§7)."""
    impl = n.meta.get("impl", "reference")
    q, k, v = n.inputs[:3]
    a = n.attrs
    if impl not in ("cann.npu_fused_infer_attention_score", "cann._npu_paged_attention"):
        _ref(g, n, f"attention {impl}: {_refused(n)}", group.name)
        return
    fia = impl == "cann.npu_fused_infer_attention_score"
    # FIA reads the cache it writes with npu_scatter_pa_kv_cache (Norm layout, §5); the ATB path
    # writes with _npu_reshape_and_cache (int32 slots).
    cache_write = "npu_scatter_pa_kv_cache" if fia else "_npu_reshape_and_cache"
    cfg = {"num_heads": int(a["num_heads"]), "num_kv_heads": int(a["num_kv_heads"]), "head_dim": int(a["head_dim"]),
           "head_dim_v": int(n.outputs[0].type.shape[-1]), "scale": float(a.get("scale") or a["head_dim"] ** -0.5),
           "causal": bool(a.get("causal", True)), "dtype": n.outputs[0].type.dtype, "fia": fia,
           "pa": bool(pa_ok), "cache_write": cache_write,
           "fia_why": "" if fia else _refused(n), "pa_why": pa_why}
    for m in g.attn_methods:
        if m["cfg"] == cfg:
            break
    else:
        m = {"name": f"attention_{len(g.attn_methods)}", "cfg": cfg}
        g.attn_methods.append(m)
    g.call(cache_write)
    if fia:
        g.call("npu_fused_infer_attention_score")
    if pa_ok:
        g.call("_npu_paged_attention")
    if not fia:
        g.fallbacks.append((group.name, f"{n.name}: prefill rows use the reference attention over the paged cache "
                                           f"(FIA refused: {cfg['fia_why']})"))
    g.emit(f"{n.outputs[0].name} = self.{m['name']}({a.get('layer', 0)}, {q}, {k}, {v}, st, kv_caches)")


# ---- the base class of generated CANN programs ------------------------------------------------------


class CannHostProgram(HostProgram):
    """Runs a generated CANN program. ``npu`` is the module whose functions are called:
    ``torch_npu`` on an Ascend machine, or ``AscendEmulator()`` (CPU emulation) anywhere."""

    CALLS: tuple[str, ...] = ()
    FALLBACKS: tuple[tuple[str, str], ...] = ()

    def __init__(self, weights: Mapping[str, torch.Tensor], device: torch.device | str = "cpu", *, npu: Any = None,
                 **options: Any) -> None:
        if npu is None:
            import torch_npu as npu  # a real Ascend stack; see docs/ascend.md for the CPU emulator
        self.npu = npu
        options.pop("kernels_dir", None)
        options.pop("capture_sizes", None)
        options.pop("use_graphs", None)
        super().__init__(weights, device, use_graphs=False, **options)
        self.prepare()

    def prepare(self) -> None:
        """Load-time weight conversions (generated)."""

    # ---- helpers the generated attention methods call ------------------------------------------------
    @staticmethod
    def host_layout(st: Any) -> tuple[list[int], list[int], torch.Tensor]:
        """Per-request query lengths, cumulative query ends and int32 context lengths, on the host."""
        qsl = st.query_start_loc.cpu().tolist()
        q_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
        return q_lens, qsl[1:], st.seq_lens.to("cpu", torch.int32)

    @staticmethod
    def reference_rows(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, st: Any,
                       rows: Sequence[int], scale: float, causal: bool) -> None:
        """Reference attention (torch) of the requests ``rows`` over the paged cache: the fallback when
        no CANN attention call takes them (e.g. FIA refused for this head dim)."""
        qsl = st.query_start_loc.cpu().tolist()
        for b in rows:
            s, e = qsl[b], qsl[b + 1]
            seq_len = int(st.seq_lens[b])
            kk, vv = read_kv_cache(k_cache, v_cache, st.block_tables[b], seq_len)
            pos = torch.arange(seq_len - (e - s), seq_len, device=q.device)
            out[s:e] = attention_reference(q[s:e], kk, vv, scale=scale, causal=causal, sliding_window=None, softcap=None,
                                           q_pos=pos)

