"""Steps with prefill tokens replayed from step graphs (codegen/step_graphs.py), checked on this CPU.

A step graph is captured at T_b tokens and S_b sequence slots and replayed for any step that fits: its tokens
padded with no-sequence rows (slot -1), its sequences with empty slots, the attention kernels finding each
program's sequence on the device. Here the graph's replay is the program's own forward over the static buffers
(a CUDA graph replays exactly the kernels it captured over those buffers), under the Triton interpreter. A run of
chunked prefills, mixed prefill + decode steps and decode-only steps whose sizes shrink and grow inside one bucket
must give Hugging Face's logits for every sequence's sampled row and the eager program's KV caches, and every
replay must see its padding as empty.
"""

from __future__ import annotations

import pytest
import torch
from triton_harness import compiled_fp32, h200_few_sms, tiny_causal_lm, use_interpreter

pytestmark = pytest.mark.interpreter

VOCAB = 64
BLOCK = 16
PER = 4  # KV blocks per sequence: up to 64 tokens each
PROMPTS = {0: [(i * 7 + 3) % VOCAB for i in range(40)], 1: [5, 17, 42, 9, 3, 8, 60], 2: [(i * 5 + 1) % VOCAB for i in range(23)],
           3: [11, 12, 13, 14, 15]}
# One step per entry: (sequence, new tokens) with prefills first, as the scheduler orders them. New tokens of a
# sequence continue its prompt; past the prompt they are DECODE tokens.
STEPS = [
    [(0, 20), (1, 7)],  # two prefills, one a chunk (27 tokens: bucket 32, 2 slots)
    [(0, 20), (2, 23), (1, 1)],  # a chunk with 20 cached tokens, a whole prompt and a decode (44: bucket 64)
    [(3, 5), (0, 1), (1, 1), (2, 1)],  # a prefill beside three decodes (8: bucket 16, 8 slots)
    [(0, 1), (1, 1), (2, 1), (3, 1)],  # decode only, 4 sequences (no decode graph holds 4: a step graph)
    [(0, 1), (2, 1)],  # fewer tokens and sequences in the same bucket: the padding must read empty again
    [(1, 1), (3, 1), (0, 1)],
]
DECODE = [9, 33, 2, 47, 21, 14]  # the token each sequence feeds at its n-th decode step


def _qwen3():
    return tiny_causal_lm("Qwen3Config", "Qwen3ForCausalLM", VOCAB, 2, hidden_size=48, intermediate_size=72,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def _deepseek_v2():
    """MLA (the latent cache, its own attention lowering) and MoE experts, routers away from ties."""
    model = tiny_causal_lm("DeepseekV2Config", "DeepseekV2ForCausalLM", VOCAB, 2, hidden_size=64, intermediate_size=96,
                           moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
                           q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, pad_token_id=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(m, name, None)
                if isinstance(w, torch.nn.Parameter) and w.dim() == 3:
                    w.copy_(torch.randn(w.shape, generator=g) * 0.05)
            if type(m).__name__.lower().endswith("gate") and getattr(m, "weight", None) is not None and m.weight.dim() == 2:
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.2)
    return model


MODELS = {"qwen3": _qwen3, "deepseek-v2-mla-moe": _deepseek_v2}
_BUILT: dict = {}


def _built(name, tmp_path_factory):
    if name not in _BUILT:
        root = tmp_path_factory.mktemp(f"step-graphs-{name}")
        model = MODELS[name]()
        _BUILT[name] = model, compiled_fp32(model, root, VOCAB, h200_few_sms(root), name)
    return _BUILT[name]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return _built("qwen3", tmp_path_factory)


@pytest.fixture(scope="module", params=sorted(MODELS))
def any_artifact(request, tmp_path_factory):
    return _built(request.param, tmp_path_factory)


class _Replayer:
    """Stands for a captured step graph: the captured forward over the static buffers, recording the padding
    (token rows past the step's T, sequence slots past its S) each replay read."""

    def __init__(self, exe, Tb, Sb, kv, seen, sizes):  # noqa: N803
        self.exe, self.Tb, self.Sb, self.kv, self.seen, self.sizes = exe, Tb, Sb, kv, seen, sizes
        self.st, self.feeds = exe.step_graph_state(Tb, Sb, kv)

    def replay(self) -> None:
        T, S = self.sizes[0]  # noqa: N806
        st = self.st
        self.seen.append((self.Tb, self.Sb, T, S, st.slot_mapping[T:].tolist(), st.seq_lens[S:].tolist(),
                          st.query_start_loc[S + 1:].tolist(), self.feeds["logits_indices"][S:].tolist()))
        outs = self.exe.forward(self.Tb, self.Sb, self.feeds, st, self.kv)
        for o, r in zip(self.outs, outs):
            if o.data_ptr() != r.data_ptr():
                o.copy_(r)


def _tokens(sid: int, upto: int) -> list[int]:
    """Sequence ``sid``'s first ``upto`` tokens: its prompt, then its decode tokens."""
    p = PROMPTS[sid]
    return (p + [DECODE[(sid + i) % len(DECODE)] for i in range(max(0, upto - len(p)))])[:upto]


def _run(art, monkeypatch, graphs: bool):
    from portlayer.codegen import step_graphs
    from portlayer.flatten.logits import feed_last_rows
    from portlayer.flatten.op_defs.attention import AttentionMetadata
    from portlayer.loaded import open_artifact
    from portlayer.runtime.validation import new_kv_cache

    use_interpreter(monkeypatch)
    loaded = open_artifact(art, interpret=True)
    exe, graph = loaded.executable(), loaded.graph
    assert exe.STEP_GRAPHS, "codegen should mark this program's steps capturable"
    names = [v.name for v in graph.inputs]
    caches = new_kv_cache(graph, len(PROMPTS), PER * BLOCK, BLOCK, torch.float32, "cpu")
    seen: list = []
    sizes = [(0, 0)]
    exe.max_seqs = 8
    if graphs:  # decode graphs hold one sequence only, so every step here replays a step graph
        exe.use_graphs, exe.capture_sizes, exe.step_sizes = True, [1], [16, 32, 64]
        monkeypatch.setattr(step_graphs, "SMALL_SLOTS", 2)

        def capture(Tb, Sb, kv):  # noqa: N803
            r = _Replayer(exe, Tb, Sb, kv, seen, sizes)
            r.outs = exe.forward(Tb, Sb, r.feeds, r.st, kv)
            return r, r.outs

        monkeypatch.setattr(exe, "_step_capture", capture)
    else:
        exe.use_graphs = False
    done = {sid: 0 for sid in PROMPTS}
    rows = []
    with torch.inference_mode():
        for step in STEPS:
            ids, pos, slots, starts, lens, tables = [], [], [], [0], [], []
            for sid, n in step:
                c = done[sid]
                ids += _tokens(sid, c + n)[c:]
                pos += list(range(c, c + n))
                slots += [(sid * PER + p // BLOCK) * BLOCK + p % BLOCK for p in range(c, c + n)]
                starts.append(starts[-1] + n)
                lens.append(c + n)
                tables.append(list(range(sid * PER, (sid + 1) * PER)))
            md = AttentionMetadata(torch.tensor(starts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                                   torch.tensor(slots, dtype=torch.int64), torch.tensor(tables, dtype=torch.int32),
                                   num_prefills=sum(1 for _, n in step if n > 1), max_query_len=max(n for _, n in step),
                                   max_seq_len=max(lens))
            feeds = {"input_ids": torch.tensor(ids), "positions": torch.tensor(pos)}
            feed_last_rows(feeds, names, md)
            sizes[0] = (len(ids), len(step))
            logits = exe.run(feeds, md, caches)[0].clone()
            for (sid, n), row in zip(step, logits):
                done[sid] += n
                rows.append((sid, done[sid], row))
    return rows, caches, seen


def test_steps_with_prefill_tokens_replay_step_graphs_and_match_hf(any_artifact, monkeypatch):
    model, art = any_artifact
    eager, eager_caches, _ = _run(art, monkeypatch, False)
    replayed, caches, seen = _run(art, monkeypatch, True)
    # every step replayed the graph of its bucket: the smallest T_b >= T, 2 slots (SMALL_SLOTS) or 8 (max_seqs)
    want = [(next(b for b in (16, 32, 64) if b >= t), 2 if s <= 2 else 8, t, s)
            for t, s in ((sum(n for _, n in st), len(st)) for st in STEPS)]
    assert [x[:4] for x in seen] == want, seen
    for Tb, Sb, T, S, slots, seq_lens, qsl, logit_rows in seen:  # noqa: N806
        assert slots == [-1] * (Tb - T), (Tb, T, slots)  # no padded row writes the cache
        assert seq_lens == [0] * (Sb - S) and qsl == [T] * (Sb - S), (Sb, S, seq_lens, qsl)  # empty slots
        assert all(0 <= r < Tb for r in logit_rows), logit_rows
    with torch.inference_mode():
        for (sid, upto, row), (_, _, eager_row) in zip(replayed, eager):
            ids = torch.tensor([_tokens(sid, upto)])
            hf = model(input_ids=ids).logits[0, -1].float()
            torch.testing.assert_close(row.float(), hf, rtol=1e-4, atol=1e-4, msg=f"sequence {sid} at {upto} tokens")
            torch.testing.assert_close(row, eager_row, rtol=1e-5, atol=1e-5)
    for layer, (pair, ref) in enumerate(zip(caches, eager_caches)):
        for c, r in zip(pair, ref):
            torch.testing.assert_close(c, r, rtol=1e-5, atol=1e-5, msg=f"KV cache of layer {layer}")


def test_a_step_graph_that_fails_to_capture_turns_step_graphs_off_and_the_step_runs_eagerly(artifact, monkeypatch):
    from portlayer.flatten.logits import feed_last_rows
    from portlayer.loaded import open_artifact
    from portlayer.runtime.validation import new_kv_cache, step_metadata

    _, art = artifact
    use_interpreter(monkeypatch)
    loaded = open_artifact(art, interpret=True)
    exe, graph = loaded.executable(), loaded.graph
    lens = [9, 4]
    md = step_metadata(lens, [0, 0], block_size=BLOCK, max_len=32, device="cpu")
    feeds = {"input_ids": torch.arange(13) % VOCAB, "positions": torch.tensor(list(range(9)) + list(range(4)))}
    feed_last_rows(feeds, [v.name for v in graph.inputs], md)
    with torch.inference_mode():
        exe.use_graphs = False
        want = exe.run(feeds, md, new_kv_cache(graph, 2, 32, BLOCK, torch.float32, "cpu"))[0]
        exe.use_graphs, exe.capture_sizes, exe.step_sizes = True, [1], [16, 32]

        def fail(Tb, Sb, kv):  # noqa: N803
            raise RuntimeError("operation not permitted when stream is capturing")

        monkeypatch.setattr(exe, "_step_capture", fail)
        with pytest.warns(UserWarning, match="failed to capture.*run eagerly"):
            got = exe.run(feeds, md, new_kv_cache(graph, 2, 32, BLOCK, torch.float32, "cpu"))[0]
    assert exe.step_sizes == []  # off for the rest of the program's life
    torch.testing.assert_close(got, want)


def test_step_graphs_switch_off_by_environment(artifact, monkeypatch):
    from portlayer.loaded import open_artifact

    _, art = artifact
    use_interpreter(monkeypatch)
    assert open_artifact(art, interpret=True).executable().step_sizes  # the Plan's buckets (step_graph_tokens)
    monkeypatch.setenv("PORTLAYER_STEP_GRAPHS", "0")
    assert open_artifact(art, interpret=True).executable().step_sizes == []


def test_static_buffers_made_inside_a_step_are_reset_at_load_outside_inference_mode(artifact, monkeypatch):
    """LLMEngine.warm_up runs a prefill step (ModelRunner.execute: inference mode), which now makes the step
    graphs' static buffers, then captures every graph outside inference mode, which resets them: they must be
    ordinary tensors (an inference tensor refuses an in-place write outside inference mode)."""
    from portlayer.flatten.logits import feed_last_rows
    from portlayer.loaded import open_artifact
    from portlayer.runtime.validation import new_kv_cache, step_metadata

    _, art = artifact
    use_interpreter(monkeypatch)
    loaded = open_artifact(art, interpret=True)
    exe, graph = loaded.executable(), loaded.graph
    exe.use_graphs, exe.capture_sizes, exe.step_sizes = True, [1], [16, 32]

    class Fake:
        def __init__(self, run):
            self.run = run

        def replay(self):
            self.run()

    def fake_step(Tb, Sb, kv):  # noqa: N803
        st, feeds = exe.step_graph_state(Tb, Sb, kv)
        outs = exe.forward(Tb, Sb, feeds, st, kv)
        return Fake(lambda: exe.forward(Tb, Sb, feeds, st, kv)), outs

    def fake_decode(B, kv):  # noqa: N803
        st, feeds = exe.graph_step_state(B, kv)
        outs = exe.forward(B, B, feeds, st, kv)
        return Fake(lambda: exe.forward(B, B, feeds, st, kv)), outs

    monkeypatch.setattr(exe, "_step_capture", fake_step)
    monkeypatch.setattr(exe, "_capture", fake_decode)
    caches = new_kv_cache(graph, 2, 32, BLOCK, torch.float32, "cpu")
    names = [v.name for v in graph.inputs]
    md = step_metadata([9, 4], [0, 0], block_size=BLOCK, max_len=32, device="cpu")
    feeds = feed_last_rows({"input_ids": torch.arange(13) % VOCAB,
                            "positions": torch.tensor(list(range(9)) + list(range(4)))}, names, md)
    one = step_metadata([1], [9], block_size=BLOCK, max_len=32, device="cpu")
    dec = feed_last_rows({"input_ids": torch.tensor([5]), "positions": torch.tensor([9])}, names, one)
    with torch.inference_mode():  # as ModelRunner.execute runs a step
        exe.run(feeds, md, caches)
        exe.run(dec, one, caches)
    assert any(k[0] == "step" for k in exe._graphs)  # the prefill replayed a step graph
    exe.capture_all(caches)  # as LLMEngine.warm_up calls it: outside inference mode
    assert not exe._step.slots.is_inference() and not exe._static.slots.is_inference()
