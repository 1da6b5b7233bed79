"""Turns a scheduled batch into one call of the compiled program.

The runner flattens the batch into vLLM's token stream (``input_ids``/``positions`` of
``[num_tokens]``) and builds the :class:`AttentionMetadata` the ``attention`` op reads:
cumulative query starts, per-sequence context lengths, the cache slot of every new token
and the padded block tables, prefills first. It talks to the program only through the
``Executable`` interface, so the reference executable and generated host programs are
interchangeable.

Logits: when the program takes a ``logits_indices`` input (flatten/logits.py adds it to
causal LMs at compile time) the runner passes the last stream row of every sequence in the
step, so ``lm_head`` runs on num_seqs rows instead of num_tokens, and keeps the rows of the
sequences due a token; otherwise it picks those rows from full logits.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

import numpy as np
import torch

from portlayer.flatten.logits import LOGITS_INDICES, feed_last_rows
from portlayer.flatten.op_defs.attention import AttentionMetadata
from portlayer.runtime.executable import Executable
from portlayer.runtime.sequence import Sequence


class ModelRunner:
    def __init__(
        self,
        executable: Executable,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        block_size: int,
        position_skip_token: int | None = None,
    ) -> None:
        self.executable = executable
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = executable.device
        # graph.meta position_skip_token (flatten/capture.py): the model numbers a sequence's positions without this
        # token (RoBERTa's padding id inside a text): embed() numbers them so
        self.position_skip_token = position_skip_token

    def prepare(self, items: Seq[tuple[Sequence, int]], pending: torch.Tensor | None = None,
                ) -> tuple[dict[str, torch.Tensor], AttentionMetadata, list[int]]:
        """Feeds, metadata, and the stream rows whose logits are sampled (one per finished-prefill/decode seq).

        ``pending``: the in-flight step's sampled tokens on the device; a sequence's last token may be
        its placeholder -(row + 1) (Sequence.append_pending), replaced on the device by ``pending[row]``."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        patch_dst: list[int] = []
        patch_src: list[int] = []
        for seq, n in items:
            start = seq.num_computed_tokens
            end = start + n
            prompt, outs = seq.prompt_token_ids, seq.output_token_ids
            np_ = len(prompt)
            if start >= np_:  # decode (or recompute of outputs): no list concatenation
                ids.extend(outs[start - np_ : end - np_])
            elif end <= np_:
                ids.extend(prompt[start:end])
            else:
                ids.extend(prompt[start:])
                ids.extend(outs[: end - np_])
            table = seq.block_table
            if n == 1:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions.extend(range(start, end))
                pos = np.arange(start, end)  # a prefill chunk: its slots by numpy, not per token in Python
                slots.extend((np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist())
            starts.append(starts[-1] + n)
            seq_lens.append(end)
            if end == seq.num_tokens:
                sample_rows.append(starts[-1] - 1)
                if outs and outs[-1] < 0:  # the input is a token of the in-flight step
                    patch_dst.append(starts[-1] - 1)
                    patch_src.append(-outs[-1] - 1)
        width = max((len(s.block_table) for s, _ in items), default=0)
        S, T = len(items), len(ids)  # noqa: N806
        # two host-to-device copies per step (one per dtype), the tensors are views of them
        small = np.zeros(2 * S + 1 + S * width, dtype=np.int32)
        small[: S + 1] = starts
        small[S + 1 : 2 * S + 1] = seq_lens
        tables = small[2 * S + 1 :].reshape(S, width)
        for row, (s, _) in enumerate(items):
            tables[row, : len(s.block_table)] = s.block_table
        P = len(patch_dst)  # noqa: N806
        if P and pending is None:
            raise RuntimeError("a placeholder token in the step's inputs but no in-flight step; this is a bug")
        big = np.fromiter(itertools.chain(ids, positions, slots, patch_dst, patch_src), dtype=np.int64,
                          count=3 * T + 2 * P)
        dev = self.device
        if dev.type == "cpu":
            small_d, big_d = torch.from_numpy(small), torch.from_numpy(big)
        elif dev.type != "cuda":
            small_d, big_d = torch.from_numpy(small).to(dev), torch.from_numpy(big).to(dev)
        else:  # from pinned memory, without waiting: a pageable copy would wait for the step in flight
            small_d = torch.from_numpy(small).pin_memory().to(dev, non_blocking=True)
            big_d = torch.from_numpy(big).pin_memory().to(dev, non_blocking=True)
        if P:
            big_d[:T].index_copy_(0, big_d[3 * T : 3 * T + P], pending.index_select(0, big_d[3 * T + P :]))
        meta = AttentionMetadata(
            query_start_loc=small_d[: S + 1],
            seq_lens=small_d[S + 1 : 2 * S + 1],
            slot_mapping=big_d[2 * T : 3 * T],
            block_tables=small_d[2 * S + 1 :].view(S, width),
            num_prefills=sum(1 for _, n in items if n > 1),
            max_query_len=max((n for _, n in items), default=0),
            max_seq_len=max(seq_lens, default=0),
        )
        feeds = {"input_ids": big_d[:T], "positions": big_d[T : 2 * T]}
        return feeds, meta, sample_rows

    @torch.inference_mode()
    def execute(self, items: Seq[tuple[Sequence, int]], pending: torch.Tensor | None = None,
                ) -> tuple[list[Sequence], torch.Tensor]:
        """Run one step; return the sequences due a token and their logits rows ([n, vocab])."""
        feeds, meta, rows = self.prepare(items, pending)
        # lm_head runs on the last row of every sequence of the step (num_seqs rows) when it can
        selects = LOGITS_INDICES in feed_last_rows(feeds, getattr(self.executable, "input_names", ()), meta)
        logits = self.executable.run(feeds, meta, self.kv_caches)[0]
        due_idx = [i for i, (seq, n) in enumerate(items) if seq.num_computed_tokens + n == seq.num_tokens]
        due = [items[i][0] for i in due_idx]
        if selects:
            if len(due_idx) == logits.shape[0]:
                return due, logits
            return due, logits[torch.tensor(due_idx, dtype=torch.long, device=logits.device)]
        if len(rows) == logits.shape[0]:
            return due, logits
        return due, logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]

    @torch.inference_mode()
    def embed(self, token_lists: Seq[Seq[int]], pooled: bool) -> torch.Tensor:
        """Encode whole sequences without a KV cache (bidirectional attention sees each sequence at once).

        ``pooled``: the graph ends in pooling ([num_seqs, hidden]); otherwise it returns the last
        hidden state per token and the runner mean-pools each sequence itself.
        """
        lens = [len(t) for t in token_lists]
        dev = self.device
        meta = AttentionMetadata.from_lens(lens, device=dev)
        ids = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.int64)
        if self.position_skip_token is None:
            positions = torch.tensor([p for n in lens for p in range(n)], dtype=torch.int64)
        else:
            from portlayer.flatten.capture import skip_positions

            positions = torch.cat([skip_positions(seg, self.position_skip_token) for seg in torch.split(ids, lens)])
        feeds = {"input_ids": ids.to(dev), "positions": positions.to(dev)}
        out = self.executable.run(feeds, meta, None)[0]
        if pooled:
            return out
        return torch.stack([seg.float().mean(0) for seg in torch.split(out, lens)]).to(out.dtype)
