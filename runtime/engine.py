"""The engine: requests in, tokens (or embeddings) out, one scheduler step at a time.

``LLMEngine`` wires scheduler -> block manager -> model runner -> sampler around one
``Executable``. Sizes come from the Plan (block size, chunk size, token budget, sequence
slots, KV budget); keyword arguments override them, which is how tests force tiny KV
budgets or chunk sizes. Everything lives on the engine instance: two engines in one
process share nothing.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from portlayer.codegen.host_support import kv_cache_dtype
from portlayer.runtime import overlap as overlap_mod
from portlayer.runtime.block_manager import BlockManager
from portlayer.runtime.embed_batches import BatchRunner, plan_batches, step_workers
from portlayer.runtime.executable import Executable
from portlayer.runtime.kv_cache import KVCacheSpec, allocate_kv_caches
from portlayer.runtime.model_runner import ModelRunner
from portlayer.runtime.sampler import Sampler, check_sampling_params
from portlayer.runtime.scheduler import Scheduler, SchedulerConfig
from portlayer.runtime.sequence import RequestOutput, RequestRejected, SamplingParams, Sequence

Prompt = str | Seq[int]


@dataclass(frozen=True)
class EngineConfig:
    """The resolved sizes the engine runs with (Plan values unless overridden)."""

    task: str
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_batched_tokens: int
    prefill_chunk_size: int
    enable_prefix_caching: bool
    max_model_len: int


class LLMEngine:
    def __init__(
        self,
        executable: Executable,
        meta: Mapping[str, Any],
        plan: Any = None,
        *,
        backend: Any = None,
        tokenizer: Any = None,
        kv_cache_budget_bytes: int | None = None,
        block_size: int | None = None,
        max_num_seqs: int | None = None,
        max_batched_tokens: int | None = None,
        prefill_chunk_size: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int | None = None,
        overlap: bool | None = None,
    ) -> None:
        self.executable, self.meta, self.plan, self.tokenizer = executable, dict(meta), plan, tokenizer
        task = self.meta.get("task", "causal_lm")
        max_pos = int(self.meta.get("max_positions") or 4096)

        def pick(given: int | None, name: str, default: int) -> int:
            if given is not None:
                return int(given)
            value = plan.value(name) if plan is not None and name in plan.names() else None
            return int(value) if value else default

        bs = pick(block_size, "kv_block_size", 16)
        chunk = pick(prefill_chunk_size, "prefill_chunk_size", 512)
        budget = pick(max_batched_tokens, "max_batched_tokens", max(chunk, 256))
        nseqs = pick(max_num_seqs, "max_num_seqs", 256)
        self.kv_caches = None
        num_blocks = 0
        if task == "causal_lm":
            spec = KVCacheSpec.from_meta(self.meta, bs, kv_cache_dtype(executable))
            kv_budget = pick(kv_cache_budget_bytes, "kv_cache_budget_bytes", 1 << 30)
            # Never more than every sequence slot at full length could use (keeps CPU tests small).
            num_blocks = min(spec.num_blocks_for(kv_budget), nseqs * -(-max_pos // bs))
            if backend is None:
                from portlayer.backends.registry import get_backend

                backend = get_backend(executable.device.type)
            self.kv_caches = allocate_kv_caches(spec, num_blocks, backend)
        self.config = EngineConfig(task, bs, num_blocks, nseqs, budget, chunk, enable_prefix_caching,
                                   min(max_pos, num_blocks * bs) if num_blocks else max_pos)  # fmt: skip
        self.block_manager = BlockManager(max(num_blocks, 1), bs, enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(nseqs, budget, chunk), self.block_manager)
        self.runner = ModelRunner(executable, self.kv_caches, bs, meta.get("position_skip_token"))
        self._backend = backend  # its descriptor's tuning steers how embedding batches share the cores
        self._embed_runner: BatchRunner | None = None
        self.sampler = Sampler(seed)
        self.eos_token_id = self.meta.get("eos_token_id")
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = self.eos_token_id[0] if self.eos_token_id else None
        self._seq_ids = itertools.count()
        self.requests: dict[str, Sequence] = {}
        self.errors: dict[str, str] = {}  # request id -> why it finished with an error
        self.num_steps = 0
        # the host prepares step N+1 while the device runs step N where launches return before the work
        # is done (the backend says so; PORTLAYER_OVERLAP=0 turns it off)
        asynchronous = backend is not None and backend.launches_asynchronously()
        self.overlap = (asynchronous and os.environ.get("PORTLAYER_OVERLAP", "1") != "0") if overlap is None else overlap
        self._inflight: overlap_mod.InFlight | None = None
        self.num_overlapped_steps = 0

    # ---- construction ----------------------------------------------------------------
    @classmethod
    def from_model(cls, model: str | os.PathLike[str], *, device: str = "cpu", dtype: torch.dtype | None = None,
                   **kwargs: Any) -> LLMEngine:  # fmt: skip
        """Capture an HF directory or built-in name and serve it with the reference executable."""
        from portlayer.flatten.builtin_models import resolve_model
        from portlayer.flatten.capture import capture

        path = resolve_model(str(model))
        graph = capture(path, dtype=dtype)  # records sentence-transformers' max_seq_length in graph.meta
        return cls.from_graph(graph, device=device, tokenizer=load_tokenizer(path), **kwargs)

    @classmethod
    def from_artifact(cls, path: str | os.PathLike[str], *, emulate: bool | None = False, interpret: bool = False,
                      **kwargs: Any) -> LLMEngine:
        """Open a compiled artifact (hashes and device checked) and serve its program.

        ``emulate=True`` runs a CANN (Ascend) artifact on the CPU emulator of the torch_npu calls
        (docs/ascend.md); ``None`` follows PORTLAYER_ASCEND_EMULATOR=1 for CANN artifacts.
        ``interpret=True`` runs a Triton artifact on this CPU under the Triton interpreter."""
        from portlayer.backends.registry import backend_class, get_backend
        from portlayer.runtime.loaded import open_artifact

        loaded = open_artifact(path, emulate=emulate, interpret=interpret)
        exe = loaded.executable()
        if loaded.interpreted and "backend" not in kwargs:  # KV caches in host memory
            kwargs["backend"] = backend_class("cpu")(loaded.descriptor, 0)
        if loaded.emulated and "backend" not in kwargs:  # KV caches in host memory, the descriptor's alignment
            kwargs["backend"] = backend_class(loaded.descriptor.device_type)(loaded.descriptor, 0, emulate=True)
        backend = kwargs.pop("backend", None) or get_backend(loaded.descriptor, index=max(loaded.device.index, 0))
        engine = cls(exe, loaded.graph.meta, loaded.plan, backend=backend, tokenizer=loaded.tokenizer(), **kwargs)
        engine.warm_up()
        return engine

    def warm_up(self) -> None:
        """Pay at load what the first request would otherwise pay (vendor GEMM handles, lazily loaded
        kernels, one CUDA graph per capture size): a prefill step of a dummy sequence in free KV blocks,
        zeroed again afterwards, then every decode graph. Devices without graphs skip it."""
        exe = self.executable
        if exe.device.type != "cuda" or self.kv_caches is None:
            return
        bs = self.config.block_size
        n = min(16, self.config.max_batched_tokens, self.config.num_blocks * bs)
        dummy = Sequence(-1, "warm-up", [0] * n, SamplingParams(temperature=0.0, max_tokens=1))
        dummy.block_table = list(range(-(-n // bs)))  # no request holds a block yet
        _, logits = self.runner.execute([(dummy, n)])
        self.sampler.greedy_rows(logits, [dummy])
        for k, v in self.kv_caches:
            k[: len(dummy.block_table)].zero_()
            v[: len(dummy.block_table)].zero_()
        capture = getattr(exe, "capture_all", None)
        if capture is not None:
            capture(self.kv_caches)
        torch.cuda.synchronize(exe.device)

    @classmethod
    def open(cls, spec: str | os.PathLike[str], **kwargs: Any) -> LLMEngine:
        """An artifact directory (has a manifest), else a model directory or built-in name captured now."""
        from pathlib import Path

        from portlayer.runtime.artifact import MANIFEST

        if (Path(spec) / MANIFEST).is_file():
            kwargs.pop("device", None)  # the artifact's device check decides
            return cls.from_artifact(spec, **kwargs)
        return cls.from_model(spec, **kwargs)

    @classmethod
    def from_graph(cls, graph: Any, *, device: str = "cpu", **kwargs: Any) -> LLMEngine:
        from portlayer.backends.registry import get_backend
        from portlayer.capabilities.policy import plan_for_graph
        from portlayer.flatten.logits import select_logit_rows
        from portlayer.runtime.executable import ReferenceExecutable

        graph = select_logit_rows(graph)  # causal LMs: lm_head only on the sampled rows
        exe = ReferenceExecutable(graph, device=device)
        backend = kwargs.pop("backend", None) or get_backend(exe.device.type)
        plan = kwargs.pop("plan", None) or plan_for_graph(graph, backend.descriptor)
        return cls(exe, graph.meta, plan, backend=backend, **kwargs)

    # ---- requests --------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue one request; raises RequestRejected (nothing queued) if it can never run."""
        if self.config.task != "causal_lm":
            raise RequestRejected(f"generate needs a causal LM; this model's task is {self.config.task!r} (use embed)")
        seq_id = next(self._seq_ids)
        rid = request_id if request_id is not None else str(seq_id)
        params = params if params is not None else SamplingParams()
        check_sampling_params(params, rid)
        if rid in self.requests:
            raise RequestRejected(f"request id {rid!r} is already in use by an unfinished request; pick another")
        ids = self._tokenize(prompt, rid)
        self._check_prompt(ids, rid)
        seq = Sequence(seq_id, rid, ids, params, arrival=seq_id)
        self.requests[rid] = seq
        self.scheduler.add(seq)
        return rid

    def _tokenize(self, prompt: Prompt, rid: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected(f"request {rid}: a text prompt needs a tokenizer, and this model has none; "
                                      "pass token ids instead")  # fmt: skip
            return list(self.tokenizer.encode(prompt))
        try:
            return [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise RequestRejected(f"request {rid}: a prompt is a text or a list of integer token ids") from None

    def _check_prompt(self, ids: list[int], rid: str) -> None:
        c, max_pos = self.config, int(self.meta.get("max_positions") or 0)
        vocab = self.meta.get("vocab_size")
        where = f"model {self.meta.get('source', self.meta.get('model_type', '?'))}"
        if not ids:
            raise RequestRejected(f"request {rid}: the prompt is empty; give at least one token")
        if vocab and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(t for t in ids if t < 0 or t >= vocab)
            raise RequestRejected(f"request {rid}: token id {bad} is outside {where}'s vocabulary [0, {vocab})")
        skip = self.meta.get("position_skip_token")
        if skip is not None and self.config.task == "causal_lm" and skip in ids:
            raise RequestRejected(f"request {rid}: the prompt holds token {skip} at position {ids.index(skip)}, which "
                                  f"{where} leaves out of its position numbering (its padding id); generation does "
                                  "not number positions around it: remove it from the prompt")
        if max_pos and len(ids) > max_pos:
            raise RequestRejected(f"request {rid}: the prompt has {len(ids)} tokens but {where} allows at most "
                                  f"{max_pos} positions (max_position_embeddings); shorten the prompt")  # fmt: skip
        if len(ids) > c.num_blocks * c.block_size:
            raise RequestRejected(
                f"request {rid}: the prompt has {len(ids)} tokens but the whole KV cache holds {c.num_blocks * c.block_size} "
                f"({c.num_blocks} blocks of {c.block_size}); shorten the prompt or raise kv_cache_budget_bytes"
            )

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")

    def abort_request(self, request_id: str) -> bool:
        """Stop ``request_id`` wherever it is (waiting or running) and free its KV blocks now.

        True if a live request was aborted; False for an unknown or already finished id (a
        client that disconnects after its last token is not an error)."""
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.finished:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        live = self._inflight is not None and any(not s.finished for s in self._inflight.due)
        return live or self.scheduler.has_unfinished()

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the program once, sample; outputs for every sequence that got a token.

        Transactional per request: a sequence's state advances only after its tokens ran and
        its next token was sampled. A failure (an exception in the program, non-finite logits,
        a sampling error) finishes only the requests it affects, with ``finish_reason="error"``
        and the message in ``error``; the engine goes on serving the others.

        With ``overlap`` (devices that run ahead of the host), an all-greedy step's tokens reach
        the host during the next step: this call launches step N+1, then returns step N's outputs
        (runtime/overlap.py); the tokens are the same.
        """
        prev, self._inflight = self._inflight, None
        batch = self.scheduler.schedule()
        if batch.empty and prev is None:
            if self.scheduler.has_unfinished():
                raise RuntimeError(f"scheduler made no progress with {len(self.scheduler.waiting)} waiting and "
                                   f"{len(self.scheduler.running)} running sequences; this is a bug")  # fmt: skip
            return []
        outputs: list[RequestOutput] = []
        launched = overlap_mod.launch(self, batch, prev, outputs, self.overlap) if not batch.empty else None
        if prev is not None:
            outputs += overlap_mod.resolve(self, prev)
        if launched is not None:
            if launched.pending is None:
                outputs += overlap_mod.sample_now(self, launched)
            else:
                self._inflight = launched
                self.num_overlapped_steps += 1
            self.num_steps += 1
        return outputs

    def _output(self, seq: Sequence, upto: int | None = None) -> RequestOutput:
        """The output of ``seq`` after its first ``upto`` output tokens (the text once it finished)."""
        try:
            text = self._detok(seq) if seq.finished else None
        except Exception as e:  # a tokenizer that cannot decode these ids: the tokens still stand
            text, self.errors[seq.request_id] = None, f"detokenizing failed ({type(e).__name__}: {e})"
        out = RequestOutput.of(seq, text, upto)
        out.error = self.errors.get(seq.request_id) if seq.finished else None
        return out

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        """Finish ``seq`` with an error output; its KV blocks go back to the pool."""
        self.scheduler.finish(seq, "error")
        self.requests.pop(seq.request_id, None)
        self.errors[seq.request_id] = f"request {seq.request_id}: {message}"
        out = RequestOutput.of(seq, None)
        out.error = self.errors[seq.request_id]
        return out

    def _detok(self, seq: Sequence) -> str | None:
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True) if self.tokenizer else None

    # ---- convenience APIs ------------------------------------------------------------
    def _submit(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None):
        if self.config.task != "causal_lm":  # a model-level mistake: raise, not per request
            raise RequestRejected(f"generate needs a causal LM; this model's task is {self.config.task!r} (use embed)")
        many = not (isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)))
        plist = list(prompts) if many else [prompts]
        pars = list(params) if isinstance(params, (list, tuple)) else [params] * len(plist)
        if len(pars) != len(plist):
            raise ValueError(f"{len(pars)} SamplingParams for {len(plist)} prompts; give one, or one per prompt")
        order: list[Sequence | RequestOutput] = []
        for i, (p, sp) in enumerate(zip(plist, pars)):
            try:
                order.append(self.requests[self.add_request(p, sp)])
            except RequestRejected as e:  # reported in place; the other requests go on
                ids = [] if isinstance(p, str) else [int(t) for t in p]
                order.append(RequestOutput(f"rejected-{i}", ids, [], [], True, "rejected", error=str(e)))
        return order

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:  # fmt: skip
        """Run prompts (texts or token-id lists) to completion; outputs in prompt order.

        A rejected prompt comes back as an output with ``error`` set and no tokens.
        """
        order = self._submit(prompts, params)
        while any(isinstance(o, Sequence) and not o.finished for o in order):
            self.step()
        return [o if isinstance(o, RequestOutput) else self._final(o) for o in order]

    def stream(self, prompts: Prompt | Seq[Prompt],
               params: SamplingParams | Seq[SamplingParams] | None = None) -> Iterator[RequestOutput]:  # fmt: skip
        """Yield each new token (``new_token_ids``) of these prompts as the steps produce them."""
        order = self._submit(prompts, params)
        yield from (o for o in order if isinstance(o, RequestOutput))
        seqs = [o for o in order if isinstance(o, Sequence)]
        mine = {s.request_id for s in seqs}
        while any(not s.finished for s in seqs):
            yield from (o for o in self.step() if o.request_id in mine)

    def _final(self, seq: Sequence) -> RequestOutput:
        seq.num_emitted = 0
        err = self.errors.get(seq.request_id)
        out = RequestOutput.of(seq, None if seq.finish_reason == "error" else self._detok(seq))
        out.error = err
        return out

    def embed(self, texts: Seq[str] | Seq[Seq[int]]) -> torch.Tensor:
        """Embeddings [n, hidden] with the model's own pooling (sentence-transformers dirs) or mean pooling."""
        if self.config.task == "causal_lm":
            raise RequestRejected("embed needs an encoder or embedding model; this one is a causal LM (use generate)")
        limit = int(self.meta.get("max_seq_length") or self.meta.get("max_positions") or 512)
        lists = []
        for i, t in enumerate(texts):
            if isinstance(t, str):
                if self.tokenizer is None:
                    raise RequestRejected(f"text {i}: this model has no tokenizer; pass token ids")
                t = self.tokenizer(t, truncation=True, max_length=limit)["input_ids"]
            lists.append([int(x) for x in t])
            if not lists[-1] or len(lists[-1]) > limit:
                raise RequestRejected(f"input {i} has {len(lists[-1])} tokens; the model takes 1 to {limit}")
        pooled = self.meta.get("task") == "embedding"
        if not lists:
            return torch.empty(0)
        # batches of similar lengths under the token budget, side by side where the descriptor says (embed_batches.py)
        if self._embed_runner is None:
            self._embed_runner = BatchRunner(*step_workers(self.executable, getattr(self._backend, "descriptor", None)))
        batches = plan_batches([len(t) for t in lists], self.config.max_batched_tokens, self._embed_runner.workers)
        outs = self._embed_runner.map(lambda b: self.runner.embed([lists[i] for i in b], pooled), batches)
        order = torch.tensor([i for b in batches for i in b])
        return torch.cat(outs)[torch.argsort(order).to(outs[0].device)]

    @property
    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {"steps": self.num_steps, "overlapped_steps": self.num_overlapped_steps,
                "preemptions": self.scheduler.num_preemptions,
                "free_blocks": bm.num_free_blocks, "num_blocks": bm.num_blocks,
                "prefix_hit_blocks": bm.stats.prefix_hit_blocks, "prefix_query_blocks": bm.stats.prefix_query_blocks}  # fmt: skip


Engine = LLMEngine


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The HF tokenizer saved beside the model, or None when the directory has none."""
    from pathlib import Path

    p = Path(path)
    if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))
