"""The replayed decode step's static inputs (codegen/host_support.HostProgram._replay), checked on this CPU.

A decode graph is captured for a batch bucket and replayed for any smaller batch, so the rows past the step's
batch must read as empty sequences (slot -1: no KV write; length 0: no attention), whatever an earlier, larger
step of the same bucket left there. Here the graph's replay is the program's own forward over the static
buffers (a CUDA graph replays exactly the kernels it captured over those buffers), run under the Triton
interpreter: a decode run whose batch shrinks and grows inside one bucket must give the eager program's logits
and KV caches, and every replay must see its padding rows empty.
"""

from __future__ import annotations

import pytest
import torch
from triton_harness import compiled_fp32, h200_few_sms, tiny_causal_lm, use_interpreter

pytestmark = pytest.mark.interpreter

VOCAB = 64
PROMPTS = [[5, 17, 42, 9, 3], [7, 8, 9], [60, 1, 33], [11, 12, 13, 14]]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay-inputs")
    model = tiny_causal_lm("Qwen3Config", "Qwen3ForCausalLM", VOCAB, 2, hidden_size=48, intermediate_size=72,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    return compiled_fp32(model, root, VOCAB, h200_few_sms(root), "qwen3-h200")


class _Replayer:
    """Stands for a captured CUDA graph: replays the captured forward over the static buffers, and records
    the padding rows (those past ``rows()``) each replay read."""

    def __init__(self, exe, B, kv, seen, rows):  # noqa: N803
        self.exe, self.B, self.kv, self.seen, self.rows = exe, B, kv, seen, rows
        self.st, self.feeds = exe.graph_step_state(B, kv)

    def replay(self) -> None:
        t = self.rows()
        self.seen.append((self.B, t, self.st.slot_mapping[t:].tolist(), self.st.seq_lens[t:].tolist()))
        outs = self.exe.forward(self.B, self.B, self.feeds, self.st, self.kv)
        for o, r in zip(self.outs, outs):
            if o.data_ptr() != r.data_ptr():
                o.copy_(r)


def _decode_run(art, monkeypatch, replay: bool, buckets: list[int], steps: tuple[int, ...]
                ) -> tuple[list[torch.Tensor], list, list]:
    from portlayer.flatten.logits import feed_last_rows
    from portlayer.loaded import open_artifact
    from portlayer.runtime.validation import new_kv_cache, step_metadata

    use_interpreter(monkeypatch)
    loaded = open_artifact(art, interpret=True)
    exe, graph = loaded.executable(), loaded.graph
    names = [v.name for v in graph.inputs]
    longest = max(len(p) for p in PROMPTS) + 8
    caches = new_kv_cache(graph, len(PROMPTS), longest, 16, torch.float32, "cpu")
    seen: list = []
    current = [0]
    if replay:  # every step replays the graph of its bucket (the smallest capture size that holds it)
        exe.use_graphs, exe.capture_sizes, exe.step_sizes = True, list(buckets), []  # the prefill stays eager

        def capture(B, kv):  # noqa: N803
            r = _Replayer(exe, B, kv, seen, lambda: current[0])
            r.outs = exe.forward(B, B, r.feeds, r.st, kv)
            return r, r.outs

        monkeypatch.setattr(exe, "_capture", capture)
    lens = [len(p) for p in PROMPTS]
    ctx = list(lens)
    logits = []
    with torch.inference_mode():
        md = step_metadata(lens, [0] * len(lens), block_size=16, max_len=longest, device="cpu")
        feeds = {"input_ids": torch.tensor([t for p in PROMPTS for t in p]),
                 "positions": torch.tensor([i for n in lens for i in range(n)])}
        feed_last_rows(feeds, names, md)
        exe.run(feeds, md, caches)  # the prefill: eager on both paths
        g = torch.Generator().manual_seed(1)
        for t in steps:  # the first t sequences decode one token each
            current[0] = t
            ids = torch.randint(0, VOCAB, (t,), generator=g)
            md = step_metadata([1] * t, ctx[:t], block_size=16, max_len=longest, device="cpu")
            feeds = {"input_ids": ids, "positions": torch.tensor(ctx[:t])}
            feed_last_rows(feeds, names, md)
            logits.append(exe.run(feeds, md, caches)[0].clone())
            for i in range(t):
                ctx[i] += 1
    return logits, caches, seen


@pytest.mark.parametrize("buckets,steps", [
    ([4], (4, 2, 3, 1, 4)),  # one bucket: the batch shrinks and grows inside it
    ([2, 4], (4, 1, 3, 2, 4)),  # two buckets: a step of the small one between steps of the large one
])
def test_a_changing_batch_replays_with_empty_padding_rows_and_equals_eager(artifact, monkeypatch, buckets, steps):
    eager, eager_caches, _ = _decode_run(artifact, monkeypatch, False, buckets, steps)
    replayed, caches, seen = _decode_run(artifact, monkeypatch, True, buckets, steps)
    want = [(next(b for b in buckets if b >= t), t) for t in steps]
    assert [s[:2] for s in seen] == want, seen  # every step replayed, each from its bucket's graph
    for bucket, t, slots, seq_lens in seen:
        assert slots == [-1] * (bucket - t) and seq_lens == [0] * (bucket - t), (bucket, t, slots, seq_lens)
    for step, (a, b) in enumerate(zip(replayed, eager)):
        assert a.shape == b.shape, step
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"decode step {step}")
    for layer, (pair, ref) in enumerate(zip(caches, eager_caches)):
        for c, r in zip(pair, ref):
            torch.testing.assert_close(c, r, rtol=1e-4, atol=1e-5, msg=f"KV cache of layer {layer}")
