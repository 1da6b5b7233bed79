"""CANN implementation of ``moe_experts``: the routed experts as two grouped matmuls.

The host program sorts the (token, choice) slots by expert with torch ops (aclnn on the NPU),
gathers the token rows in that order, and runs ``torch_npu.npu_grouped_matmul`` in its
single-tensor form (x = [rows [M, H]], weight = [W [E, K, N]], ``group_type=0`` splits M by
``group_list``, the cumulative row count per expert with ``group_list_type=0``, ``split_item=2``
returns one [M, N] tensor) for gate|up, ``npu_swiglu`` (ascend-ops.md §4: gate = first half) for
SiLU, a second grouped matmul for down, then weights and scatters the slots back and sums each
token's top-k in a fixed order. The expert weights are transposed to [E, K, N] once at load.

Unconfirmed: npu_grouped_matmul is not in ../shared/reference/ascend-ops.md yet. Its signature and
the 3-D weight / tensor group_list form are read from the torch_npu 7.0 API docs (ptaoplist,
"npu_grouped_matmul(x, weight, *, bias=None, ..., group_list=None, split_item=0, group_type=None,
group_list_type=0, act_type=0, output_dtype=None)"); the emulator (backends/ascend_emulator.py)
checks only that form. npu_moe_gating_top_k / npu_moe_init_routing are not used: the router
stays the model's own ops, and the sort is three torch calls.
"""

from __future__ import annotations

from collections.abc import Mapping

from portlayer.backends.impls import Verdict, codegen_is, implementation
from portlayer.codegen import cann as C
from portlayer.codegen.lowering import KernelGroup
from portlayer.flatten.ir import Node, TensorType

FLOATS = ("float16", "bfloat16", "float32")  # torch_npu 7.0 docs: A2 grouped matmul takes fp16, bf16, fp32
ACT = {"gelu": "F.gelu({h}[:, :{i}].float())", "gelu_tanh": "F.gelu({h}[:, :{i}].float(), approximate='tanh')"}


def _moe_ok(node: Node, types: Mapping[str, TensorType]) -> Verdict:
    x, ids, w, gu, down = (types[i] for i in node.inputs)
    if not all(isinstance(d, int) for d in (*x.shape[1:], *ids.shape[1:], *gu.shape, *down.shape)):
        return False, "expert weights, hidden size and top_k must be static"
    if x.dtype not in FLOATS or gu.dtype != x.dtype or down.dtype != x.dtype:
        return False, f"x {x.dtype} and expert weights {gu.dtype}/{down.dtype} must be one of {list(FLOATS)}"
    if int(gu.shape[0]) > 1024:
        return False, f"{gu.shape[0]} experts: group_list holds at most 1024 groups (unconfirmed limit, kept safe)"
    if node.attrs.get("activation", "silu") not in ("silu", *ACT):
        return False, f"activation {node.attrs.get('activation')!r} has no emitter"
    return True, ""


def emit_moe(g: C.CannState, n: Node, group: KernelGroup) -> None:
    """Sort slots by expert, gate|up grouped matmul, activation, down grouped matmul, combine."""
    x, ids, w, gu, dn = n.inputs
    out = n.outputs[0].name
    e, k = int(g.types[gu].shape[0]), int(g.types[ids].shape[1])
    hidden, inter = int(g.types[x].shape[1]), int(g.types[dn].shape[2])
    for name, shape in ((gu, f"[E, {hidden}, {2 * inter}]"), (dn, f"[E, {inter}, {hidden}]")):
        line = f"W.{name}_kn = W.{name}.transpose(1, 2).contiguous()  # {shape}: npu_grouped_matmul's [E, K, N]"
        if line not in g.prepare:
            g.prepare.append(line)
    g.call("npu_grouped_matmul")
    gmm = "group_list=moe_ends, split_item=2, group_type=0, group_list_type=0)[0]"
    act = n.attrs.get("activation", "silu")
    if act == "silu":
        g.call("npu_swiglu")
        act_line = "moe_a = npu.npu_swiglu(moe_h, dim=-1)  # silu(gate) * up, gate = first half (§4)"
    else:
        act_line = f"moe_a = ({ACT[act].format(h='moe_h', i=inter)} * moe_h[:, {inter}:].float()).to(moe_h.dtype)"
    for line in [
        f"# moe_experts: {e} experts, top-{k}; slots sorted by expert, two grouped matmuls",
        f"moe_ids = {ids}.reshape(-1).long()",
        f"moe_ok = (moe_ids >= 0) & (moe_ids < {e})  # ids out of range contribute nothing (the op's reference)",
        f"moe_flat = torch.where(moe_ok, moe_ids, {e - 1})",
        "moe_order = torch.argsort(moe_flat, stable=True)",
        f"moe_ends = torch.cumsum(torch.bincount(moe_flat, minlength={e}), 0)",
        f"moe_h = npu.npu_grouped_matmul([{x}.index_select(0, moe_order // {k})], [W.{gu}_kn], {gmm}",
        act_line,
        f"moe_y = npu.npu_grouped_matmul([moe_a], [W.{dn}_kn], {gmm}",
        f"moe_wt = torch.where(moe_ok, {w}.reshape(-1).float(), 0.0)[moe_order]",
        f"moe_slots = torch.zeros(T * {k}, {hidden}, dtype=torch.float32, device={x}.device).index_copy_("
        "0, moe_order, moe_y.float() * moe_wt[:, None])",
        f"{out} = moe_slots.view(T, {k}, {hidden}).sum(dim=1).to({x}.dtype)  # fixed order over the slots",
    ]:
        g.emit(line)


implementation("moe_experts", name="cann.npu_grouped_matmul", family="cann", priority=50,
               supported=codegen_is("cann"), supports=_moe_ok)(C.cann_lowering(emit_moe))
