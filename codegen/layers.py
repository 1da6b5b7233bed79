"""Identical transformer layers are generated once: one method per distinct layer, and a loop.

Each kernel group belongs to the layer of its anchor node (the HF module path of the node,
``model.layers.3.…``). For a layer, the code of its groups is rewritten into a canonical form:
values it makes get local names (``l3_self_attn_q_proj`` -> ``self_attn_q_proj``), its own weights
are read from a per-layer namespace ``P`` (``model_layers_3_…`` -> ``P.self_attn_q_proj_weight``),
its planned buffers from a per-layer namespace ``B``, the values carried in from the previous layer
become ``x0, x1, …`` and its KV-cache index becomes ``layer``. Consecutive layers whose canonical
code is identical, character for character, share one method called in a loop; anything that
does not fit (a different first layer, a value read across layers) stays inline, so the result is
always exactly the straight-line program, only shorter.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

_MODULE_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?=\.|$)")
_IDENT = re.compile(r"(?<![\w.])([A-Za-z_]\w*)")


@dataclass
class Block:
    """One kernel group's host code and what it touches."""

    title: str
    lines: list[str]
    made: list[str]  # values the block defines (compute outputs, view aliases)
    reads: list[str]  # values it reads (not params)
    params: list[str]  # weights it reads
    layer: int | None
    kv_layers: list[int] = field(default_factory=list)  # attention KV-cache indices it uses


@dataclass
class LayerMethod:
    name: str
    first: int
    last: int  # inclusive
    lines: list[str]
    carried: list[str]  # canonical names of carried inputs (x0, x1, ...)
    shared: list[str]  # values read by name from outside (graph inputs, values made before the layers)
    returns: list[str]  # canonical names returned, in carried order
    params: dict[str, list]  # local -> [name template with {} for the layer index, index offset]
    buffers: dict[str, list]  # local -> [value template, index offset]


@dataclass
class Program:
    lines: list[str]  # the forward body
    methods: list[LayerMethod]
    outputs: list[str]  # what forward returns (loop variables where a loop made them)


def module_layer(source: str | None) -> int | None:
    m = _MODULE_LAYER.search(source or "")
    return int(m.group(1)) if m else None


def _rename(lines: Sequence[str], mapping: Mapping[str, str], attr_map: Mapping[str, Mapping[str, str]]) -> list[str]:
    """Rename bare identifiers by ``mapping`` and ``NS.name`` attributes by ``attr_map[NS]``."""
    def sub(line: str) -> str:
        for ns, m in attr_map.items():
            if m:
                line = re.sub(rf"\b{ns}\.([A-Za-z_]\w*)", lambda mo, m=m, ns=ns: m.get(mo.group(1), f"{ns}.{mo.group(1)}"),
                              line)
        return _IDENT.sub(lambda mo: mapping.get(mo.group(1), mo.group(1)), line) if mapping else line

    return [sub(ln) for ln in lines]


RESERVED = {"K", "W", "B", "P", "T", "S", "st", "kv_caches", "k_cache", "v_cache", "bm", "layer", "self", "torch",
            "triton", "ref", "W_T", "gemm_block_m", "gemv_blocks", "attention_batched", "npu", "F", "feeds"}


def _local(name: str, layer: int, taken: set[str], fallback: str) -> tuple[str, list | None]:
    """(local name, [template with {} for the layer index, offset]) for a value or weight that
    ``layer``'s code makes or reads. The offset covers values named after the previous layer
    that a fused group at the start of this layer makes (layer 0's residual add fused into
    layer 1's first norm)."""
    for d in (0, -1):
        i = layer + d
        if i < 0:
            continue
        for pat in (rf"^l{i}_", rf"(?<![0-9])_{i}_"):
            m = re.search(pat, name)
            if not m:
                continue
            local = name[m.end():] + ("_prev" if d else "")
            tmpl = name[: m.start()] + m.group(0).replace(str(i), "{}") + name[m.end():]
            if local.isidentifier() and local not in taken and local not in RESERVED and not local[0].isdigit():
                return local, [tmpl, d]
    return fallback, None


@dataclass
class _Canon:
    text: list[str]
    carried_real: list[str]
    outs_real: set[str]
    params: dict[str, list]
    buffers: dict[str, list]
    shared: list[str]
    local_of: dict[str, str]
    ok: bool


def _canonical(blocks: list[Block], layer: int, param_users: Mapping[str, set[int]], prev_made: set[str],
               later_reads: set[str], graph_outputs: set[str], buffered: set[str]) -> _Canon:
    made = [v for b in blocks for v in b.made]
    made_set = set(made)
    taken: set[str] = set()
    local_of: dict[str, str] = {}
    buffers: dict[str, str] = {}
    ok = True
    for i, v in enumerate(made):
        loc, tmpl = _local(v, layer, taken, f"v{i}")
        ok &= tmpl is not None
        local_of[v] = loc
        taken.add(loc)
        if v in buffered:
            buffers[loc] = tmpl or [v, 0]
    carried: list[str] = []
    shared: list[str] = []
    for b in blocks:
        for r in b.reads:
            if r in made_set or r in carried or r in shared:
                continue
            (carried if r in prev_made else shared).append(r)
    mapping = dict(local_of)
    mapping.update({r: f"x{i}" for i, r in enumerate(carried)})
    params: dict[str, str] = {}
    p_map: dict[str, str] = {}
    for b in blocks:
        for p in b.params:
            if p in p_map or param_users.get(p, set()) != {layer}:
                continue
            loc, tmpl = _local(p, layer, set(params), p)
            ok &= tmpl is not None
            params[loc] = tmpl or [p, 0]
            p_map[p] = f"P.{loc}"
    b_map = {v: f"B.{local_of[v]}" for v in made if v in buffered}
    text: list[str] = []
    for b in blocks:
        lines = _rename(b.lines, mapping, {"W": p_map, "B": b_map})
        for kv in b.kv_layers:
            expr = "layer" if kv == layer else f"layer + {kv - layer}"
            lines = [ln.replace(f"kv_caches[{kv}]", f"kv_caches[{expr}]").replace(f"'layer': {kv}", f"'layer': {expr}")
                     .replace(f"layer={kv},", f"layer={expr},") for ln in lines]
        if text:
            text.append("")
        text.append(f"# {_rename([b.title], mapping, {})[0]}")
        text += lines
    outs = {v for v in made if v in later_reads or v in graph_outputs}
    return _Canon(text, carried, outs, params, buffers, shared, local_of, ok)


def fold_layers(blocks: Sequence[Block], graph_outputs: Sequence[str], buffered: set[str],
                params: set[str]) -> Program:
    """Straight-line blocks -> a forward body with loops over identical layers (same result)."""
    blocks = list(blocks)
    order: list[int] = []
    spans: dict[int, tuple[int, int]] = {}
    for i, b in enumerate(blocks):
        if b.layer is None:
            continue
        if b.layer in spans:
            if spans[b.layer][1] != i - 1:
                return straight_line(blocks, graph_outputs)  # a layer's groups are not contiguous
            spans[b.layer] = (spans[b.layer][0], i)
        else:
            spans[b.layer] = (i, i)
            order.append(b.layer)
    param_users: dict[str, set[int]] = {}
    for b in blocks:
        for p in b.params:
            param_users.setdefault(p, set()).add(-1 if b.layer is None else b.layer)
    canon: dict[int, _Canon] = {}
    for k, layer in enumerate(order):
        s, e = spans[layer]
        prev = spans[order[k - 1]] if k else None
        prev_made = {v for b in blocks[prev[0]:prev[1] + 1] for v in b.made} if prev else set()
        later = {r for b in blocks[e + 1:] for r in b.reads}
        canon[layer] = _canonical(blocks[s:e + 1], layer, param_users, prev_made, later, set(graph_outputs), buffered)

    def chains(a: int, b: int) -> bool:
        ca, cb = canon[a], canon[b]
        return (ca.ok and cb.ok and b == a + 1 and ca.text == cb.text and ca.shared == cb.shared
                and ca.outs_real == set(cb.carried_real) and len(cb.carried_real) == len(ca.carried_real)
                and all(t.format(b + d) in buffered for t, d in cb.buffers.values())
                and all(t.format(b + d) in params for t, d in cb.params.values()))

    runs: list[list[int]] = []
    for layer in order:
        if runs and chains(runs[-1][-1], layer):
            runs[-1].append(layer)
        else:
            runs.append([layer])
    lines: list[str] = []
    methods: list[LayerMethod] = []
    rename: dict[str, str] = {}
    cursor = 0
    for run in runs:
        s, e = spans[run[0]][0], spans[run[-1]][1]
        lines += _inline(blocks[cursor:s], rename)
        cursor = e + 1
        first, last = canon[run[0]], canon[run[-1]]
        ret_local = _return_order(first, run[0], canon[run[1]] if len(run) > 1 else None)
        last_ret = [_real_of(last, loc) for loc in ret_local] if ret_local is not None else []
        if ret_local is None or set(last_ret) != last.outs_real or not first.ok or not all(
                t.format(run[0] + d) in buffered for t, d in first.buffers.values()):
            lines += _inline(blocks[s:e + 1], rename)
            continue
        name = f"layer_{run[0]}"
        carried = [f"x{i}" for i in range(len(first.carried_real))]
        methods.append(LayerMethod(name, run[0], run[-1], first.text, carried, first.shared, ret_local,
                                   first.params, first.buffers))
        loop_vars = [f"h{len(methods) - 1}_{i}" for i in range(len(carried))]
        init = [rename.get(v, v) for v in first.carried_real]
        shared = [rename.get(v, v) for v in first.shared]
        lines += ["", f"# layers {run[0]}..{run[-1]}: identical, one method ({name})",
                  f"{', '.join(loop_vars)}, = {', '.join(init)},",
                  f"for layer in range({run[0]}, {run[-1] + 1}):",
                  f"    {', '.join(loop_vars)}, = self.{name}({', '.join(['layer', *loop_vars, *shared])}, T, S, st, "
                  "kv_caches)"]
        rename.update(dict(zip(last_ret, loop_vars)))
    lines += _inline(blocks[cursor:], rename)
    return Program(lines, methods, [rename.get(o, o) for o in graph_outputs])


def straight_line(blocks: Sequence[Block], graph_outputs: Sequence[str]) -> Program:
    """The program without folding: every group's code in order."""
    return Program(_inline(blocks, {}), [], list(graph_outputs))


def _real_of(c: _Canon, local: str) -> str:
    return next((v for v, loc in c.local_of.items() if loc == local), "")


def _return_order(c: _Canon, layer: int, nxt: _Canon | None) -> list[str] | None:
    """The method returns, in the order it takes its carried inputs: carried input i, a value the
    previous layer made (``l{layer-1}_add``), comes back as this layer's value of the same local
    name (``l{layer}_add``). Without such names, the next layer's reading order decides."""
    order: list[str] = []
    for v in c.carried_real:
        loc, tmpl = _local(v, layer - 1, set(), "")
        if tmpl is None or tmpl[1] != 0 or loc not in c.local_of.values():
            order = []
            break
        order.append(loc)
    if order and {_real_of(c, loc) for loc in order} == c.outs_real:
        return order
    if nxt is not None and set(nxt.carried_real) == c.outs_real:
        return [c.local_of[v] for v in nxt.carried_real]
    return None


def _inline(blocks: Sequence[Block], rename: Mapping[str, str]) -> list[str]:
    out: list[str] = []
    for b in blocks:
        out.append("")
        out.append(f"# {b.title}")
        out += _rename(b.lines, rename, {}) if rename else b.lines
    return out
