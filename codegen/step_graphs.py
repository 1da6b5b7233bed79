"""CUDA graphs of steps with prefill tokens (prefill chunks, with or without decodes), bucketed by token count.

A decode step's graph is keyed by its batch (host_support.HostProgram._replay). A step with prefill tokens
launched ~12 kernels a layer eagerly: ~7.5 ms of host for the Qwen3-0.6B shape on the H200's host, against
4.6 ms of kernels for 1,848 prefill tokens (scripts/gpu_mixed_step.py, session 18), so prefill and serving's
mixed steps ran at the host's speed. This captures them too: at T_b tokens (the Plan's ``step_graph_tokens``
buckets) and S_b sequence slots (16, 64, else the program's max_seqs: ``slot_sizes``). A step's tokens are copied into
static buffers padded to T_b (slot -1: no KV write; no sequence owns them), its sequences into S_b slots padded
with empty ones (no new token, no context). Every attention launch's grid is a function of T and S alone
(codegen/kernels/attention.py ``prefill_lines``: each prefill program finds its sequence on the device; decode
programs of prefill or empty slots return), so one graph replays any split of its tokens into prefill chunks
and decodes. A program says it can (``STEP_GRAPHS``, set by codegen when no group reads the step's host-side
layout); others run such steps eagerly, as before.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

from portlayer.flatten.logits import LOGITS_INDICES
from portlayer.flatten.op_defs.attention import AttentionMetadata

SMALL_SLOTS = 16  # the fewest sequence slots of a step graph (then 4x as many, then max_seqs: slot_sizes)
# Buckets up to this many tokens are captured at load (a first request's prompt); larger ones on first use: a
# capture costs about two of its steps (a warm-up forward, then the capture), which at 2,048 tokens of a large model
# would add seconds to every load for steps a server meets within its first seconds anyway.
LOAD_TOKENS = 256
ENV = "PORTLAYER_STEP_GRAPHS"  # 0: steps with prefill tokens launch their kernels eagerly (an A/B switch)


def enabled() -> bool:
    """Step graphs are on unless PORTLAYER_STEP_GRAPHS=0."""
    return os.environ.get(ENV, "1") != "0"


class StepGraphFailed(RuntimeError):
    """A step graph could not be captured; the program has turned step graphs off and runs such steps eagerly."""


def slot_sizes(most: int) -> list[int]:
    """The sequence-slot counts of step graphs: SMALL_SLOTS, 4x that, then every slot (``most``)."""
    return sorted({min(SMALL_SLOTS, most), min(4 * SMALL_SLOTS, most), most})


def seq_slots(sequences: int, most: int) -> int:
    """The sequence slots of the step graph for a step of ``sequences`` sequences (at most ``most``)."""
    return next(s for s in slot_sizes(most) if s >= sequences)


class StepGraphs:
    """Mixed into HostProgram: capture and replay of steps with prefill tokens (see the module docstring).
    Uses the program's ``forward``, ``INPUTS``, ``max_seqs``, ``use_graphs``, ``_graphs``, ``_graph_of`` and
    ``_table_width``."""

    STEP_GRAPHS = False  # codegen sets it: every group's host lines read only T, S and the step's device tensors
    step_sizes: list[int]
    _step: SimpleNamespace | None

    def _token_rows(self, name: str, T: int, S: int) -> int:  # noqa: N803
        """Rows of feed ``name`` in a step of T tokens and S sequences (logits_indices: one per sequence)."""
        return S if name == LOGITS_INDICES else T

    def _step_graphable(self, T: int, feeds: Mapping[str, torch.Tensor], meta: AttentionMetadata | None,  # noqa: N803
                        kv_caches: Any) -> bool:
        if not (self.STEP_GRAPHS and self.use_graphs and self.step_sizes and kv_caches is not None and meta is not None
                and meta.block_tables is not None and meta.slot_mapping is not None and T <= self.step_sizes[-1]):
            return False
        S = int(meta.seq_lens.shape[0])  # noqa: N806
        return (0 < S <= self.max_seqs and int(meta.slot_mapping.shape[0]) == T
                and meta.block_tables.shape[1] <= self._table_width(kv_caches)
                and all(feeds[k].dim() == 1 and int(feeds[k].shape[0]) == self._token_rows(k, T, S)
                        for k in self.INPUTS))

    def _step_static(self, kv_caches: Any) -> SimpleNamespace:
        if self._step is None:
            T, S, dev = self.step_sizes[-1], self.max_seqs, self.device  # noqa: N806
            width = self._table_width(kv_caches)
            with torch.inference_mode(False):  # made inside a step (inference mode), reset at load (outside it)
                self._step = self._new_step_static(T, S, width, dev)
        return self._step

    def _new_step_static(self, T: int, S: int, width: int, dev: torch.device) -> SimpleNamespace:  # noqa: N803
        return SimpleNamespace(
            feeds={k: torch.zeros(self._token_rows(k, T, S), dtype=torch.int64, device=dev) for k in self.INPUTS},
            slots=torch.full((T,), -1, dtype=torch.int64, device=dev),
            qsl=torch.zeros(S + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.zeros(S, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(S, width, dtype=torch.int32, device=dev),
            slots_upto=0,  # slots at and past this hold -1 (no KV write) whatever the last step wrote
            lens_upto=0,  # sequence slots at and past this hold length 0
            pool=None,  # one memory pool for every step graph (they never run at once)
        )

    def _step_reset(self, s: SimpleNamespace) -> None:
        """The static inputs as a capture at load wants them: no token writes the cache, no sequence has tokens."""
        s.slots[: s.slots_upto].fill_(-1)
        s.seq_lens[: s.lens_upto].fill_(0)
        s.qsl.fill_(0)
        s.slots_upto = s.lens_upto = 0

    def _step_replay(self, T: int, feeds: Mapping[str, torch.Tensor], meta: AttentionMetadata,  # noqa: N803
                     kv_caches: Any) -> list[torch.Tensor]:
        """Copy the step into the static buffers (padding as the module docstring says) and replay its graph."""
        s = self._step_static(kv_caches)
        S = int(meta.seq_lens.shape[0])  # noqa: N806
        Tb, Sb = next(t for t in self.step_sizes if t >= T), seq_slots(S, self.max_seqs)  # noqa: N806
        for k in self.INPUTS:
            s.feeds[k][: self._token_rows(k, T, S)].copy_(feeds[k], non_blocking=True)
        if LOGITS_INDICES in s.feeds and S < Sb:  # a padded slot's row: any row below T_b (an older step's may not be)
            s.feeds[LOGITS_INDICES][S:Sb].zero_()
        s.slots[:T].copy_(meta.slot_mapping, non_blocking=True)
        if s.slots_upto > T:
            s.slots[T : s.slots_upto].fill_(-1)
        s.slots_upto = T
        s.qsl[: S + 1].copy_(meta.query_start_loc, non_blocking=True)
        if S < Sb:
            s.qsl[S + 1 : Sb + 1].fill_(T)  # empty slots: no new tokens
        s.seq_lens[:S].copy_(meta.seq_lens, non_blocking=True)
        if s.lens_upto > S:
            s.seq_lens[S : s.lens_upto].fill_(0)
        s.lens_upto = S
        w = int(meta.block_tables.shape[1])
        s.block_tables[:S, :w].copy_(meta.block_tables, non_blocking=True)
        key = ("step", Tb, Sb, self._cache_pointers(kv_caches))
        if key not in self._graphs:
            self._graphs[key] = self._step_capture_or_off(Tb, Sb, kv_caches)
        graph, outs = self._graphs[key]
        graph.replay()
        rows = S if LOGITS_INDICES in self.INPUTS else T
        return [o[:rows].clone() for o in outs]

    def step_graph_state(self, Tb: int, Sb: int, kv_caches: Any) -> tuple[Any, dict[str, torch.Tensor]]:  # noqa: N803
        """The step state and feeds a step graph of ``Tb`` tokens and ``Sb`` sequence slots is captured with: views
        of the static buffers ``_step_replay`` fills. num_prefills and num_decodes are nonzero so both attention
        launches are captured; each decode program's sequence is its slot (decode_offset 0)."""
        from portlayer.codegen.host_support import StepState

        s = self._step_static(kv_caches)
        st = StepState(Tb, Sb, 1, Sb, Tb, s.qsl[: Sb + 1], s.seq_lens[:Sb], s.slots[:Tb], s.block_tables[:Sb],
                       s.block_tables.stride(0), int(kv_caches[0][0].shape[1]), True, None, kv_caches, self.device,
                       decode_offset=0)
        st.workspace = self._workspaces.__dict__
        return st, {k: v[: self._token_rows(k, Tb, Sb)] for k, v in s.feeds.items()}

    def _step_capture_or_off(self, Tb: int, Sb: int, kv_caches: Any) -> tuple[Any, list[torch.Tensor]]:  # noqa: N803
        """Capture, or on failure turn step graphs off (said once) and raise StepGraphFailed: the caller runs eagerly."""
        try:
            return self._step_capture(Tb, Sb, kv_caches)
        except Exception as e:  # a capture error leaves nothing half-made: the graph is dropped, the step runs eagerly
            self.step_sizes = []
            for key in [k for k in self._graphs if k[0] == "step"]:  # the ones made before: never replayed again
                del self._graphs[key]
            warnings.warn(f"step graph at {Tb} tokens / {Sb} sequence slots failed to capture ({type(e).__name__}: "
                          f"{e}); steps with prefill tokens now run eagerly (set {ENV}=0 to skip the attempt)",
                          stacklevel=3)
            raise StepGraphFailed(str(e)) from e

    def _step_capture(self, Tb: int, Sb: int, kv_caches: Any) -> tuple[Any, list[torch.Tensor]]:  # noqa: N803
        st, feeds = self.step_graph_state(Tb, Sb, kv_caches)
        s = self._step
        if s.pool is None:
            s.pool = torch.cuda.graph_pool_handle()
        return self._graph_of(Tb, Sb, feeds, st, kv_caches, s.pool)

    def step_graph_keys(self) -> list[tuple[int, int]]:
        """Every (T_b, S_b) a step graph may be captured at: the token buckets, each with the slot counts a step
        of that many tokens can need (a sequence has at least one token)."""
        sizes = slot_sizes(self.max_seqs)
        # a step of t tokens holds at most t sequences: the slot counts up to the first that covers t
        return [(t, sb) for t in self.step_sizes for i, sb in enumerate(sizes) if i == 0 or sizes[i - 1] < t]

    def capture_step_graphs(self, kv_caches: Any, upto: int = LOAD_TOKENS) -> int:
        """Capture the step graphs of buckets up to ``upto`` tokens now (at load); the rest on first use."""
        if not (self.STEP_GRAPHS and self.use_graphs and self.step_sizes and kv_caches is not None):
            return 0
        s = self._step_static(kv_caches)
        self._step_reset(s)
        pointers = self._cache_pointers(kv_caches)
        keys = [(tb, sb) for tb, sb in self.step_graph_keys() if tb <= upto]
        for tb, sb in keys:
            if ("step", tb, sb, pointers) not in self._graphs:
                try:
                    self._graphs[("step", tb, sb, pointers)] = self._step_capture_or_off(tb, sb, kv_caches)
                except StepGraphFailed:
                    return 0
        return len(keys)
