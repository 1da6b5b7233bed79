"""shard: tensor parallelism (Megatron-LM's layout, as vLLM, SGLang and MLC use it) for one rank.

A pure function of the graph, the world size N (the Plan's ``tensor_parallel``) and the rank:
the returned graph is the *same program on every rank* (identical structure and attributes, so
one artifact holds it once); only its weights differ per rank.

- attention: Q, K, V projections are column-parallel by heads (each rank keeps num_heads / N query
  heads and their KV heads; with fewer KV heads than ranks each KV head is replicated on
  N / num_kv_heads ranks), the head-local ops on their way (reshape, rope, per-head norms) follow,
  and the output projection is row-parallel, followed by ``all_reduce``.
- MLP: the projections feeding a per-token pointwise region (gate|up -> silu * mul, or fc -> gelu)
  are column-parallel over the intermediate size; the projection reading it is row-parallel,
  followed by ``all_reduce``.
- vocabulary: the embedding is vocab-parallel (each rank looks up the ids of its slice, zeros
  elsewhere, ``all_reduce``); the vocabulary projection is column-parallel and ``all_gather``
  restores the whole row for the sampler (padded slices, when N does not divide the vocabulary,
  are cut off again).
- everything else (norms, residual adds, rope tables) is replicated. A row-parallel bias is kept
  on rank 0 only, so the sum adds it once.

- routed experts (``moe_experts``): split inside each expert (passes/shard_moe.py, which says
  why); multi-head latent attention (``mla_attention``): split by heads, its latent cache
  replicated (passes/shard_mla.py), or kept whole when its query path cannot be proven head-local.

What cannot be sharded this way (heads not divisible by N, a fused QKV projection, another
gemm-kind op) is refused with the reason, never sharded silently wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from portlayer.errors import PortlayerError
from portlayer.flatten.ir import Graph, Node, TensorType, Value
from portlayer.flatten.ops import get_op
from portlayer.passes.context import PassContext
from portlayer.passes.shard_mla import keep_mla_whole, split_mla
from portlayer.passes.shard_moe import expert_cut
from portlayer.passes.shard_rewrite import Rule, cut, insert_after, reinfer

VOCAB_START = "tp_vocab_start"
HEAD_LOCAL = ("reshape", "rope", "rms_norm", "layer_norm", "cast")


class ShardError(PortlayerError):
    """The model cannot be split over the requested number of ranks; the message says why."""


def world_size_of(ctx: PassContext) -> int:
    try:
        return int(ctx.plan.value("tensor_parallel") or 1)
    except KeyError:
        return 1


def shard(graph: Graph, ctx: PassContext) -> Graph:
    """The pass: rank ``ctx.options['tp_rank']`` (default 0) of the Plan's tensor_parallel degree."""
    n = world_size_of(ctx)
    if n == 1:
        return graph
    coll = ctx.descriptor.raw.get("collectives")
    if not isinstance(coll, Mapping) or not coll.get("library"):
        raise ShardError(f"--tensor-parallel {n}: descriptor {ctx.descriptor.name} ({ctx.descriptor.origin}) names no "
                         "collectives library; add \"collectives\": {\"library\": ..., \"torch_backend\": ...} to it")
    quant = ctx.plan.weight_quantization if "weight_quantization" in ctx.plan.names() else "none"
    if quant not in ("none", None):
        raise ShardError(f"--tensor-parallel {n} with weight quantization {quant!r} is not supported yet (its quality "
                         "gate and calibration run the graph in one process); compile with --quantize none")
    return shard_graph(graph, n, int(ctx.options.get("tp_rank", 0)), dict(coll))


class _Sharder:
    def __init__(self, graph: Graph, n: int, rank: int) -> None:
        self.g, self.n, self.rank = graph, n, rank
        self.prod = graph.producers()
        self.users = graph.users()
        self.types = graph.value_types()
        self.rules: dict[str, Rule] = {}
        self.after: dict[str, list[tuple[str, dict[str, Any]]]] = {}  # linear name -> collectives to append
        self.done: set[str] = set()
        m = graph.meta
        self.where = m.get("source") or m.get("model_type") or "the model"

    def fail(self, why: str) -> None:
        raise ShardError(f"tensor parallelism over {self.n} ranks: {why} (model {self.where}); "
                         "compile without --tensor-parallel, or pick a degree the model divides")

    def rule(self, param: str | None, r: Rule) -> None:
        if param is None:
            return
        if param not in self.g.params:
            self.fail(f"{param} is computed, not a parameter; only parameter weights can be sharded")
        old = self.rules.get(param)
        if old is not None and (old.kind, old.dim, old.index) != (r.kind, r.dim, r.index):
            self.fail(f"parameter {param} is shared by ops that need different cuts ({old.kind} and {r.kind})")
        self.rules[param] = r

    # ---- heads -------------------------------------------------------------------------------
    def head_split(self, heads: int, kv: int) -> tuple[list[int], list[int]]:
        n, r = self.n, self.rank
        if heads % n:
            self.fail(f"{heads} attention heads do not split over {n} ranks")
        if kv % n == 0:
            kv_heads = list(range(r * kv // n, (r + 1) * kv // n))
        elif n % kv == 0:
            kv_heads = [r // (n // kv)]  # fewer KV heads than ranks: each is replicated on n // kv ranks
        else:
            self.fail(f"{kv} KV heads neither split over nor replicate evenly onto {n} ranks")
        return list(range(r * heads // n, (r + 1) * heads // n)), kv_heads

    def trace_projection(self, value: str, where: str) -> tuple[Node, list[Node]]:
        chain: list[Node] = []
        node = self.prod.get(value)
        while node is not None and node.op in HEAD_LOCAL:
            chain.append(node)
            node = self.prod.get(node.inputs[0])
        if node is None or node.op != "linear" or node.inputs[1] not in self.g.params:
            self.fail(f"the attention {where} input {value} is not a projection of its own "
                      f"(found {node.op if node else 'a graph input'}): fused QKV projections are not sharded yet")
        return node, chain

    def attention(self, att: Node) -> None:
        a = att.attrs
        heads, kv, hd = int(a["num_heads"]), int(a["num_kv_heads"]), int(a["head_dim"])
        q_heads, kv_heads = self.head_split(heads, kv)
        for value, sel, full, where in ((att.inputs[0], q_heads, heads, "q"), (att.inputs[1], kv_heads, kv, "k"),
                                        (att.inputs[2], kv_heads, kv, "v")):
            lin, chain = self.trace_projection(value, where)
            width = self.types[value].shape[-1] if self.types[value].rank == 3 else hd
            rows = [h * width + i for h in sel for i in range(width)]
            self.rule(lin.inputs[1], Rule("column", 0, rows))
            if len(lin.inputs) > 2:
                self.rule(lin.inputs[2], Rule("column", 0, rows))
            self.done.add(lin.name)
            for c in chain:
                _rescale_shape(c, full, len(sel))
        att.attrs.update(num_heads=len(q_heads), num_kv_heads=len(kv_heads))
        views, proj = self.output_projection(att)
        if isinstance(proj, str):
            self.fail(proj)
        self.split_output(att, views, proj, heads, q_heads)

    def output_projection(self, att: Node) -> tuple[list[Node], Node | str]:
        """attention -> head-merging views -> the output projection, or why the path is not that."""
        node, value, views = att, att.outputs[0].name, []
        while True:
            us = self.users.get(value, [])
            if len(us) != 1:
                return views, f"the attention output {value} feeds {len(us)} ops; expected one output projection"
            node = us[0]
            if node.op == "linear":
                return views, node
            if node.op not in ("reshape", "cast"):
                return views, f"the attention output reaches {node.op} ({node.name}) before its output projection"
            views.append(node)
            value = node.outputs[0].name

    def split_output(self, att: Node, views: list[Node], proj: Node, heads: int, q_heads: list[int]) -> None:
        vdim = self.types[att.outputs[0].name].shape[-1]
        for v in views:
            _rescale_shape(v, heads, len(q_heads), vdim)
        self.row_parallel(proj, [h * vdim + i for h in q_heads for i in range(vdim)])

    def row_parallel(self, lin: Node, cols: list[int]) -> None:
        self.rule(lin.inputs[1], Rule("column", 1, cols))
        if len(lin.inputs) > 2 and lin.inputs[2] is not None:
            self.rule(lin.inputs[2], Rule("rank0"))
        self.after.setdefault(lin.name, []).append(("all_reduce", {"reduce": "sum", "world_size": self.n}))
        self.done.add(lin.name)

    # ---- MLP -----------------------------------------------------------------------------------
    def mlp(self, down: Node) -> None:
        """``down`` reads a per-token pointwise region whose only activation inputs are projections."""
        width = self.types[down.inputs[0]].shape[-1]
        region: list[Node] = []
        leaves: list[Node] = []
        params: list[str] = []
        stack, seen = [down.inputs[0]], set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in self.g.params:
                params.append(v)
                continue
            node = self.prod.get(v)
            if node is None:
                return  # a graph input feeds it: not an MLP
            if node.op == "linear" and node.name not in self.done and node.inputs[1] in self.g.params:
                leaves.append(node)
                continue
            if get_op(node.op).kind != "pointwise":
                return
            region.append(node)
            stack += [i for i in node.inputs if i is not None]
        if not region or not leaves or width % self.n:
            return
        members = {r.name for r in region} | {down.name}
        for node in region + leaves:  # the region is private to this MLP
            for o in node.outputs:
                if o.name in self.g.outputs or any(u.name not in members for u in self.users.get(o.name, [])):
                    return
        if any(self.types[leaf.outputs[0].name].shape[-1] != width for leaf in leaves):
            return
        for p in params:  # per-channel parameters of the region follow the split; scalars stay
            t = self.g.params[p]
            if t.rank and t.shape[-1] == width:
                if t.rank != 1:
                    return
        per = width // self.n
        rows = list(range(self.rank * per, (self.rank + 1) * per))
        for leaf in leaves:
            self.rule(leaf.inputs[1], Rule("column", 0, rows))
            if len(leaf.inputs) > 2 and leaf.inputs[2] is not None:
                self.rule(leaf.inputs[2], Rule("column", 0, rows))
            self.done.add(leaf.name)
        for p in params:
            if self.g.params[p].rank == 1 and self.g.params[p].shape[0] == width:
                self.rule(p, Rule("column", 0, rows))
        self.row_parallel(down, rows)

    # ---- mixture of experts (passes/shard_moe.py) ------------------------------------------------
    def experts(self, node: Node) -> None:
        """Every expert keeps 1/N of its intermediate channels; the partial combines are summed after."""
        ec = expert_cut(node, self.g, self.n, self.rank)
        if isinstance(ec, str):
            self.fail(ec)
        self.rule(node.inputs[3], Rule("column", 1, ec.gate_up))
        self.rule(node.inputs[4], Rule("column", 2, ec.down))
        node.attrs["intermediate_size"] = ec.per_rank
        self.after.setdefault(node.name, []).append(("all_reduce", {"reduce": "sum", "world_size": self.n}))
        self.done.add(node.name)

    # ---- vocabulary ----------------------------------------------------------------------------
    def vocab_rows(self, vocab: int) -> tuple[int, list[int]]:
        per = -(-vocab // self.n)
        rows = [i if i < vocab else -1 for i in range(self.rank * per, (self.rank + 1) * per)]
        return per, rows

    def lm_head(self) -> Node | None:
        if len(self.g.outputs) != 1:
            return None
        node = self.prod.get(self.g.outputs[0])
        while node is not None and node.op != "linear":
            ins = [i for i in node.inputs if i is not None and i in self.prod]
            if get_op(node.op).kind != "pointwise" or len(ins) != 1:
                return None
            node = self.prod[ins[0]]
        if node is None or node.name in self.done or node.inputs[1] not in self.g.params:
            return None
        return node

    def shard_lm_head(self, head: Node) -> None:
        vocab = int(self.g.params[head.inputs[1]].shape[0])
        per, rows = self.vocab_rows(vocab)
        self.rule(head.inputs[1], Rule("column", 0, rows))
        if len(head.inputs) > 2 and head.inputs[2] is not None:
            self.rule(head.inputs[2], Rule("column", 0, rows))
        todo = [("all_gather", {"dim": -1, "world_size": self.n})]
        if per * self.n != vocab:
            todo.append(("slice", {"dim": -1, "start": 0, "end": vocab, "step": 1}))
        self.after[head.name] = todo
        self.done.add(head.name)


def _rescale_shape(node: Node, full: int, per: int, width: int | None = None) -> None:
    """A head-local reshape keeps its meaning on ``per`` of ``full`` heads: [.., full, d] -> [.., per, d]
    and a merged [.., full*d] -> [.., per*d]."""
    if node.op != "reshape":
        return
    shape = list(node.attrs["shape"])
    if -1 in shape:
        return
    if len(shape) >= 2 and shape[-2] == full:
        shape[-2] = per
    elif width is not None and shape[-1] == full * width:
        shape[-1] = per * width
    else:
        raise ShardError(f"tensor parallelism: reshape {node.name} to {shape} does not split by heads "
                         f"({full} heads); this attention layout is not sharded yet")
    node.attrs["shape"] = shape


def shard_graph(graph: Graph, n: int, rank: int, collectives: Mapping[str, Any] | None = None) -> Graph:
    """Rank ``rank`` of ``n``: the shared program, with this rank's weight shards in ``weights``."""
    if not 0 <= rank < n:
        raise ShardError(f"rank {rank} is not in a tensor-parallel group of {n}")
    g = graph.copy()
    s = _Sharder(g, n, rank)
    other = [x.name for x in g.nodes if get_op(x.op).kind == "gemm"
             and x.op not in ("linear", "matmul", "linear_wq", "moe_experts")]
    if other:
        s.fail(f"ops {sorted({g.node(x).op for x in other})} have no tensor-parallel rule")
    if any(x.op == "linear_wq" for x in g.nodes):
        s.fail("the model's weights are already block-quantized (linear_wq); shard a float model")
    atts = g.find("attention")
    for att in atts:
        s.attention(att)
    replicated = []
    for att in g.find("mla_attention"):
        why = split_mla(s, att)
        if why is not None:
            keep_mla_whole(s, att)
            replicated.append(f"{att.name} (mla_attention, every rank computes all heads: {why})")
    for moe in g.find("moe_experts"):
        s.experts(moe)
    head = s.lm_head()
    if head is not None:
        s.shard_lm_head(head)
    for lin in g.find("linear"):
        if lin.name not in s.done:
            s.mlp(lin)
    emb = [x for x in g.find("embedding") if x.inputs[0] in g.params]
    vocab_info = _shard_embeddings(g, s, emb)
    # weights of this rank
    for p, r in s.rules.items():
        w = g.weights[p]
        if r.kind == "rank0":
            w = w if rank == 0 else torch.zeros_like(w)
        else:
            w = cut(w, r)
        g.weights[p] = w
        g.params[p] = TensorType(g.params[p].dtype, tuple(w.shape))
    insert_after(g, s.after)
    reinfer(g)
    meta_heads = {"num_heads": atts[0].attrs["num_heads"], "num_kv_heads": atts[0].attrs["num_kv_heads"]} if atts else {}
    full_kv = int(graph.meta.get("num_kv_heads") or 0)
    g.meta.update(meta_heads)
    g.meta["tensor_parallel"] = {
        "world_size": n,
        "collectives": dict(collectives or {}),
        "kv_heads_replicated": bool(atts) and full_kv < n,
        "replicated": replicated,
        "params": {p: r.kind if r.kind == "rank0" else f"{r.kind}:{r.dim}" for p, r in sorted(s.rules.items())},
        **vocab_info,
    }
    return g


def _shard_embeddings(g: Graph, s: _Sharder, embs: list[Node]) -> dict[str, Any]:
    if not embs:
        return {}
    info: dict[str, Any] = {}
    for emb in embs:
        w, ids = emb.inputs[0], emb.inputs[1]
        vocab = int(g.params[w].shape[0])
        per, rows = s.vocab_rows(vocab)
        s.rule(w, Rule("column", 0, rows))
        info = {"vocab_size": vocab, "vocab_per_rank": per}
        start = VOCAB_START if len(embs) == 1 else f"{VOCAB_START}_{emb.name}"  # each table its own slice offset
        if start not in g.params:
            g.params[start] = TensorType("int64", (1,))
            g.weights[start] = torch.tensor([s.rank * per], dtype=torch.int64)
        base = emb.name
        id_shape = list(s.types[ids].shape)
        new = [
            Node(f"{base}_tp_local", "sub", [ids, start], [], {"scalar": None, "reverse": False}),
            Node(f"{base}_tp_ge", "ge", [f"{base}_tp_local"], [], {"scalar": 0, "reverse": False}),
            Node(f"{base}_tp_lt", "lt", [f"{base}_tp_local"], [], {"scalar": per, "reverse": False}),
            Node(f"{base}_tp_mine", "logical_and", [f"{base}_tp_ge", f"{base}_tp_lt"], [], {"scalar": None, "reverse": False}),
            Node(f"{base}_tp_ids", "where", [f"{base}_tp_mine", f"{base}_tp_local"], [], {"x_scalar": None, "y_scalar": 0}),
        ]
        mask_shape = [*id_shape, 1]
        out = emb.outputs[0].name
        tail = [
            Node(f"{base}_tp_mask", "reshape", [f"{base}_tp_mine"], [], {"shape": mask_shape}),
            Node(f"{base}_tp_rows", "where", [f"{base}_tp_mask", f"{out}_tp_part"], [], {"x_scalar": None, "y_scalar": 0.0}),
            Node(f"{base}_tp_sum", "all_reduce", [f"{base}_tp_rows"], [], {"reduce": "sum", "world_size": s.n}),
        ]
        for x in new + tail:
            x.meta = {"source": emb.meta.get("source", base), "why": f"vocab-parallel embedding over {s.n} ranks"}
            x.outputs = [Value(x.name, TensorType("float32", ()))]  # typed by reinfer
        emb.inputs = [w, f"{base}_tp_ids"]
        emb.outputs = [Value(f"{out}_tp_part", emb.outputs[0].type)]
        tail[-1].outputs = [Value(out, emb.outputs[0].type)]
        i = g.nodes.index(emb)
        g.nodes[i:i + 1] = new + [emb] + tail
    return info
