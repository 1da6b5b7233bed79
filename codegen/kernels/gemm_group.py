"""A GEMM kernel group as the fuse pass may form it, and its lowering on both sides of the rows rule.

A group is ``prologue`` (nothing, or [add,] rms_norm whose output only the group's linears read),
then ``linears`` (one, or several of that one activation) and ``epilogue`` (pointwise nodes over
their output). At rows <= ``tuning.gemv_max_tokens`` it is one few-rows launch (gemv_fused.py), and
up to ``tuning.gemv_dot_max_tokens`` one launch of the same kernel's tensor-core tier; above, the host program runs what each part would have been on its own: the norm kernel, then
the vendor / Triton GEMMs (codegen/kernels/gemm.py), so those buffers are the lowering's scratch.
The fuse pass only asks ``accepts_gemm_group``; nothing here re-decides its grouping.
"""

from __future__ import annotations

from dataclasses import dataclass

from portlayer.codegen.expr import IndexContext, Unsupported, lower_chain
from portlayer.codegen.kernels import gemm
from portlayer.codegen.kernels.context import GenContext, host_numel
from portlayer.codegen.kernels.gemm_merged import above_rule, can_merge, merged_joint
from portlayer.codegen.kernels.gemv_fused import joint_gemv, norm_prologue, sibling_gemv
from portlayer.codegen.kernels.gemv_tiles import few_rows_tiers, tier_why
from portlayer.codegen.kernels.reduction import build_reduction, split_row_norm
from portlayer.codegen.lowering import GroupCode, GroupQuery, KernelGroup
from portlayer.codegen.spec import FLOAT_DTYPES
from portlayer.flatten.ir import Node


@dataclass
class GemmParts:
    prologue: list[Node]
    linears: list[Node]
    epilogue: list[Node]
    order: list[Node]

    @property
    def core(self) -> list[Node]:
        """Linears and epilogue in graph order (the epilogue may sit between two linears)."""
        return [n for n in self.order if n not in self.prologue]


def split_parts(nodes: list[Node]) -> GemmParts:
    first = next((i for i, n in enumerate(nodes) if gemm.kind_of(n) == "gemm"), 0)
    core = nodes[first:]
    return GemmParts(nodes[:first], [n for n in core if gemm.kind_of(n) == "gemm"],
                     [n for n in core if gemm.kind_of(n) != "gemm"], list(nodes))


def _accepts_prologue(query: GroupQuery, parts: GemmParts, members: set[str]) -> tuple[bool, str]:
    if int(getattr(query, "gemv_rows", 0)) <= 0:
        return False, ("a norm prologue runs in the few-rows kernel only, and this descriptor has none "
                       "(tuning.gemv_max_tokens = 0, no tuning.gemv_dot_max_tokens): the norm stays its own kernel")
    try:
        norm, pro, epi = split_row_norm(parts.prologue, query.types)
    except Unsupported as e:
        return False, f"the GEMM prologue is [add,] rms_norm: {e}"
    if norm.op != "rms_norm" or epi:
        return False, f"the GEMM prologue is [add,] rms_norm, not {[n.op for n in parts.prologue]}"
    y = norm.outputs[0].name
    x_t = query.types[norm.inputs[0]]
    if x_t.rank != 2 or norm.outputs[0].type.dtype not in FLOAT_DTYPES:
        return False, f"the prologue normalises [rows, K] float rows, not {x_t}"
    cap = int(getattr(query, "gemv_weight_bytes", 0))
    for n in parts.linears:
        if n.op not in ("linear", "linear_wq"):
            return False, f"{n.name} is {n.op}: the few-rows kernels take a linear or linear_wq"
        if cap > 0 and query.types[n.inputs[1]].nbytes({}) > cap:
            return False, (f"{n.name}'s weight is above tuning.gemv_max_weight_mib: the vendor GEMM runs it at "
                           "every row count, so the norm stays its own kernel")
        if n.inputs[0] != y:
            return False, f"{n.name} reads {n.inputs[0]}, not the norm's output {y}"
    if query.used_outside(y, members):
        return False, f"{y} is read outside the kernel, which never stores the normalised rows at decode"
    return True, ""


def _accepts_joint(query: GroupQuery, parts: GemmParts, members: set[str]) -> tuple[bool, str]:
    lins, epi = parts.linears, parts.epilogue
    n0 = query.types[lins[0].inputs[1]].shape[0]
    for n in lins:
        if query.types[n.inputs[1]].shape[0] != n0:
            return False, f"{n.name} has {query.types[n.inputs[1]].shape[0]} outputs, not {n0}: a joint epilogue combines equal shapes"
        if query.used_outside(n.outputs[0].name, members):
            return False, f"{n.outputs[0].name} is read outside the kernel, which stores only the epilogue's value"
    produced = {v.name for n in parts.core for v in n.outputs}
    why = gemm.epilogue_shape_refusal(epi, lins[0].outputs[0].type.shape)
    if why:
        return False, why
    for n in epi:
        for i in n.inputs:
            if i is not None and i not in produced and i not in query.graph.params:
                return False, f"epilogue operand {i} of sibling linears is not a parameter or one of their outputs"
    for n in epi[:-1]:
        if query.used_outside(n.outputs[0].name, members):
            return False, f"{n.outputs[0].name} is read outside the kernel, which stores only its last value"
    try:
        lower_chain(epi, query.types, lins[0].outputs[0].type.shape, gemm.GEMM_IDX,
                    bound={n.outputs[0].name: f"y{i}" for i, n in enumerate(lins)}, prefix="e")
        lower_chain(epi, query.types, lins[0].outputs[0].type.shape, IndexContext(full="offs", mask="mask"))
    except Unsupported as e:
        return False, f"the epilogue cannot be generated: {e}"
    return True, ""


def accepts_gemm_group(query: GroupQuery, nodes: list[Node]) -> tuple[bool, str]:
    """[add,] rms_norm prologue (few-rows descriptors only), then one linear with its epilogue,
    sibling linears of one input, or sibling linears of equal N with an epilogue combining them."""
    parts = split_parts(nodes)
    if not parts.linears:
        return False, "a GEMM group holds a linear"
    members = {n.name for n in nodes}
    if parts.prologue:
        ok, why = _accepts_prologue(query, parts, members)
        if not ok:
            return ok, why
    core = parts.core
    if len(parts.linears) > 1 and parts.epilogue:
        ok, why = gemm.accepts_gemm(query, parts.linears)
        return _accepts_joint(query, parts, members) if ok else (ok, why)
    return gemm.accepts_gemm(query, core)


def gemm_group_scratch(group: KernelGroup) -> list[str]:
    """What the rows-above-the-rule path writes that leaves no group: the normalised rows, and the
    linears' outputs before a (joint) epilogue kernel reads them."""
    parts = split_parts(group.nodes)
    out = [parts.prologue[-1].outputs[0].name] if parts.prologue else []
    if len(parts.linears) > 1 and parts.epilogue:
        return out + [n.outputs[0].name for n in parts.linears]
    core = KernelGroup(group.name, group.impl, group.family, group.anchor, parts.core, [], [])
    return out + gemm.gemm_scratch(core)


def _sub(group: KernelGroup, tag: str, nodes: list[Node], outputs: list[str]) -> KernelGroup:
    made = {v.name for n in nodes for v in n.outputs}
    inputs = list(dict.fromkeys(i for n in nodes for i in n.inputs if i and i not in made))
    return KernelGroup(f"{group.name}_{tag}", group.impl, group.family, nodes[0].name, nodes, inputs, outputs)


def _few_rows_ok(ctx: GenContext, linears: list[Node]) -> bool:
    cap = ctx.gemv_max_weight_bytes
    return bool(few_rows_tiers(ctx)) and all(n.op in ("linear", "linear_wq")
                                           and (cap <= 0 or ctx.types[n.inputs[1]].nbytes({}) <= cap) for n in linears)


def _joint_one_by_one(ctx: GenContext, group: KernelGroup, parts: GemmParts, core_out: list[str]) -> GroupCode:
    """Each linear its own GEMM, the epilogue after the one that feeds it first (no merge)."""
    code = GroupCode()
    owner = next((n for n in parts.linears if n.outputs[0].name in parts.epilogue[0].inputs), parts.linears[0])
    for n in parts.linears:
        if n is not owner:
            one = gemm._build_one(ctx, _sub(group, n.name, [n], [n.outputs[0].name]), few_rows=False)
            code.kernels += one.kernels
            code.buffers += one.buffers
            code.lines += one.lines
    tail = gemm._build_one(ctx, _sub(group, owner.name, [owner, *parts.epilogue], core_out), few_rows=False)
    code.kernels += tail.kernels
    code.buffers += [b for b in tail.buffers if b not in code.buffers]
    code.lines += tail.lines
    return code


def build_gemm_group(ctx: GenContext, group: KernelGroup) -> GroupCode:
    """Both sides of the rows rule: one few-rows launch, else the parts as separate kernels."""
    parts = split_parts(group.nodes)
    joint = len(parts.linears) > 1 and bool(parts.epilogue)
    if not parts.prologue and not joint and len(parts.linears) == 1:
        return gemm.build_gemm(ctx, group)
    code = GroupCode()
    rest: list[str] = []
    pro = None
    if parts.prologue:
        y = parts.prologue[-1].outputs[0].name
        sums = [v for v in group.outputs if v == parts.prologue[0].outputs[0].name and len(parts.prologue) == 2]
        norm = build_reduction(ctx, _sub(group, "norm", parts.prologue, sums + [y]))
        code.kernels += norm.kernels
        code.buffers += norm.buffers
        rest += norm.lines
        pro = norm_prologue(ctx, parts.prologue, group.outputs)
    core_out = [v for v in group.outputs if v not in code.buffers]
    if joint and can_merge(ctx, parts.linears):  # one vendor GEMM on the concatenated weights, then the epilogue
        out_name = parts.epilogue[-1].outputs[0].name
        tail = GroupCode(buffers=[out_name])
        merged = merged_joint(ctx, parts.linears, parts.epilogue, out_name, tail)
        one = _joint_one_by_one(ctx, group, parts, core_out) if ctx.triton_gemm_max_tokens > 0 else GroupCode()
        tail.kernels += one.kernels
        tail.buffers += [b for b in one.buffers if b not in tail.buffers]
        tail.lines = above_rule(ctx, host_numel(ctx.types[parts.linears[0].inputs[0]].shape[:-1]), one.lines, merged)
    elif joint:
        tail = _joint_one_by_one(ctx, group, parts, core_out)
    else:
        tail = gemm.build_gemm(ctx, _sub(group, "core", parts.core, core_out), few_rows=not pro)
    code.kernels += tail.kernels
    code.buffers += [b for b in tail.buffers if b not in code.buffers]
    code.merged.update(tail.merged)
    rest += tail.lines
    if not pro and not joint:
        code.lines = rest
        return code
    if not _few_rows_ok(ctx, parts.linears):
        code.lines = rest
        return code
    branches = []
    for limit, dot in few_rows_tiers(ctx):
        if joint:
            spec, few, _ = joint_gemv(ctx, parts.linears, parts.epilogue, pro, dot=dot)
        elif len(parts.linears) > 1:
            spec, few = sibling_gemv(ctx, parts.linears, pro, dot=dot)
        else:
            core = _sub(group, "core", parts.core, core_out)
            spec, args, const, cfg = gemm.build_gemm_kernel(ctx, core, few_rows=True, prologue=pro, dot=dot)
            few = gemm._gemv_lines(ctx, core, spec, args, const, cfg, tail=f", {pro.eps!r}")
        code.kernels.append(spec)
        branches.append((limit, few, tier_why(dot, ("norm in the prologue, " if pro else "") + "one launch, ")))
    m = host_numel(ctx.types[parts.linears[0].inputs[0]].shape[:-1])
    code.lines = gemm._by_rows(m, branches, rest)
    return code
