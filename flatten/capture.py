"""Capture a Hugging Face model into the Flat IR with torch.export.

The model is wrapped so that its inputs are the flat token stream (token ids and
positions, both ``[num_tokens]``), exported once with a dynamic token dimension, converted
op by op (from_export) and then raised to portable ops (patterns).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from portlayer.errors import PortlayerError
from portlayer.flatten import hf_attention, hf_moe
from portlayer.flatten.ir import Graph

TOKEN_SYMBOL = "num_tokens"


class CaptureError(PortlayerError, RuntimeError):
    """A model could not be captured; the message says what and what to do."""


@dataclass
class SentenceTransformerInfo:
    pooling: str | None  # mean | cls | last
    normalize: bool
    max_seq_length: int | None = None


def _read_sentence_transformer(path: Path) -> SentenceTransformerInfo | None:
    modules = path / "modules.json"
    if not modules.exists():
        return None
    try:
        mods = json.loads(modules.read_text())
    except json.JSONDecodeError as e:
        raise CaptureError(f"{modules} is not valid JSON ({e}); fix or remove it") from e
    pooling, normalize = None, False
    for m in mods:
        kind = m.get("type", "")
        if kind.endswith("Pooling"):
            cfg_path = path / m.get("path", "") / "config.json"
            cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
            if cfg.get("pooling_mode_cls_token"):
                pooling = "cls"
            elif cfg.get("pooling_mode_lasttoken"):
                pooling = "last"
            elif cfg.get("pooling_mode_mean_tokens", True):
                pooling = "mean"
            for unsupported in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens"):
                if cfg.get(unsupported):
                    raise CaptureError(f"{cfg_path}: {unsupported} is not supported; use mean, cls or last-token pooling")
        elif kind.endswith("Normalize"):
            normalize = True
    max_len = None
    st_cfg = path / "sentence_bert_config.json"
    if st_cfg.exists():
        max_len = json.loads(st_cfg.read_text()).get("max_seq_length")
    return SentenceTransformerInfo(pooling, normalize, int(max_len) if max_len else None)


#: set to 0 to load safetensors weights with transformers' copying loader instead of memory maps
MAPPED_ENV = "PORTLAYER_MAPPED_LOAD"
#: set to 1 to skip the non-finite check of loaded weights (it reads every tensor once: minutes on huge models)
SKIP_FINITE_ENV = "PORTLAYER_SKIP_WEIGHT_FINITE_CHECK"


def load_hf_model(path: str | os.PathLike[str], dtype: torch.dtype | None = None,
                  check_finite: bool | None = None, mapped: bool | None = None) -> torch.nn.Module:
    """Load a local HF directory (config.json + weights) without touching the network.

    Safetensors weights are bound as memory maps (flatten/checkpoint.py: no copy of the model in
    memory) unless ``mapped=False`` or $PORTLAYER_MAPPED_LOAD=0; quantized checkpoints and
    pickled weights take transformers' own file loading.

    Refused, naming the file or the tensors: an unreadable config.json or model type, a
    corrupt or truncated safetensors file, tensors whose shapes do not match the config,
    tensors the model does not have, and (unless ``check_finite=False`` or
    $PORTLAYER_SKIP_WEIGHT_FINITE_CHECK=1) NaN/Inf weights. Tensors missing from the
    checkpoint are recorded on the module; capture() refuses them if the graph uses them.
    """
    import transformers

    p = Path(path)
    if not (p / "config.json").exists():
        raise CaptureError(
            f"{p} is not a Hugging Face model directory: config.json is missing. "
            "Pass a directory written by save_pretrained(), or a built-in example name."
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hf_attention.register()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    config = _load_config(p)
    _check_safetensors_files(p)
    archs = config.architectures or []
    from portlayer.flatten.task import TaskInferenceError, infer_task

    try:
        causal = infer_task(config, where=str(p / "config.json")) == "causal_lm"
    except TaskInferenceError as e:
        raise CaptureError(str(e)) from None
    cls = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    kwargs: dict[str, Any] = {"attn_implementation": hf_attention.IMPL_NAME, "output_loading_info": True,
                              "ignore_mismatched_sizes": True}  # mismatches are reported below, by name
    if dtype is not None:
        kwargs["dtype"] = dtype
    from portlayer.flatten import checkpoint

    files = checkpoint.checkpoint_files(p)
    if mapped is None:
        mapped = os.environ.get(MAPPED_ENV, "1") != "0"
    mapped = mapped and bool(files) and getattr(config, "quantization_config", None) is None
    binding = None
    try:
        if mapped:
            model, info, binding = checkpoint.load_mapped(checkpoint.model_class(cls, config), config, files, kwargs)
        else:
            model, info = cls.from_pretrained(str(p), config=config, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise CaptureError(f"could not load the model in {p}: {type(e).__name__}: {str(e)[:1000]}") from None
    model._portlayer_binding = binding.to_json() if binding else {"weights": "copied by from_pretrained"}  # type: ignore[assignment]
    _check_loading_info(p, model, info, archs)
    if check_finite if check_finite is not None else os.environ.get(SKIP_FINITE_ENV) != "1":
        _check_finite(p, model)
    hf_moe.use_portlayer_experts(model)
    return model.eval()


def _load_config(p: Path) -> Any:
    import transformers

    cfg_path = p / "config.json"
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CaptureError(f"{cfg_path}: not valid JSON ({str(e)[:200]}); fix the file or re-save the model") from None
    if not isinstance(raw, dict):
        raise CaptureError(f"{cfg_path}: must hold a JSON object (the model config), found {type(raw).__name__}")
    if not isinstance(raw.get("model_type"), str):
        raise CaptureError(f"{cfg_path}: has no \"model_type\" string; re-save the model with save_pretrained()")
    try:
        return transformers.AutoConfig.from_pretrained(str(p))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CaptureError(f"{cfg_path}: model_type {raw['model_type']!r} cannot be loaded by transformers "
                           f"{transformers.__version__} ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None


def _check_safetensors_files(p: Path) -> None:
    """Open each *.safetensors header (no tensor data read): a corrupt or truncated file is named."""
    from safetensors import safe_open

    for f in sorted(p.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                st.keys()
        except Exception as e:  # safetensors' own error type (SafetensorError) or OSError
            raise CaptureError(f"{f}: not a readable safetensors file ({str(e)[:200]}); the file is corrupt or "
                               "truncated, copy or re-save it") from None


def _check_loading_info(p: Path, model: torch.nn.Module, info: dict[str, Any], archs: list[str]) -> None:
    mismatched = list(info.get("mismatched_keys") or [])
    if mismatched:
        rows = [f"{k}: checkpoint {list(a)} vs model {list(b)}" for k, a, b in mismatched[:10]]
        raise CaptureError(f"{p}: {len(mismatched)} tensors do not have the shapes config.json implies:\n  "
                           + "\n  ".join(rows) + "\nThe weights and config.json do not belong together.")
    unexpected = sorted(info.get("unexpected_keys") or [])
    if unexpected:
        head_dropped = bool(archs) and type(model).__name__ not in archs  # base model from a checkpoint with a head
        msg = (f"{p}: {len(unexpected)} tensors in the checkpoint are not part of {type(model).__name__}: "
               f"{', '.join(unexpected[:10])}")
        if not head_dropped:
            raise CaptureError(msg + "; the checkpoint does not match config.json (wrong architecture or renamed tensors)")
        import warnings

        warnings.warn(msg + f" (the {archs[0]} head is not captured)", UserWarning, stacklevel=3)
    state = model.state_dict()
    missing = [k for k in sorted(info.get("missing_keys") or []) if k in state]
    model._portlayer_missing_weights = {k: state[k].data_ptr() for k in missing}  # type: ignore[assignment]


def _has_nonfinite(t: torch.Tensor) -> bool:
    """NaN or Inf anywhere in ``t``: min and max in one pass (NaN propagates through both; ~30x
    faster than isfinite().all(), which also allocates a bool copy of the tensor)."""
    if not t.is_floating_point() or not t.numel():
        return False
    try:
        lo, hi = torch.aminmax(t.detach())
    except (RuntimeError, NotImplementedError):  # dtypes without aminmax on this build (float8)
        return not bool(torch.isfinite(t).all())
    return not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)))


def _check_finite(p: Path, model: torch.nn.Module) -> None:
    bad = [n for n, t in model.state_dict().items() if _has_nonfinite(t)]
    if bad:
        raise CaptureError(f"{p}: {len(bad)} weight tensors hold NaN or Inf: {', '.join(bad[:10])}; the checkpoint is "
                           f"damaged (set {SKIP_FINITE_ENV}=1 to skip this check)")


def check_missing_weights(module: torch.nn.Module, graph: Graph) -> None:
    """Refuse a graph whose outputs depend on tensors the checkpoint did not have (they would be
    random). Missing tensors feeding only dead code (e.g. a BERT pooler under last_hidden_state) pass."""
    missing: dict[str, int] = getattr(module, "_portlayer_missing_weights", None) or {}
    if not missing:
        return
    live = set(graph.outputs)
    for node in reversed(graph.nodes):
        if any(o.name in live for o in node.outputs):
            live.update(i for i in node.inputs if i is not None)
    ptrs = {t.data_ptr() for name, t in graph.weights.items() if name in live}
    used = [k for k, ptr in missing.items() if ptr in ptrs or k.replace(".", "_") in live]
    if used:
        raise CaptureError(f"{type(module).__name__}: {len(used)} tensors the model's outputs use are missing from the "
                           f"checkpoint (they would be random): {', '.join(used[:10])}; the checkpoint is incomplete")


def _set_attn_impl(model: torch.nn.Module) -> None:
    hf_attention.register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(hf_attention.IMPL_NAME)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = hf_attention.IMPL_NAME
    hf_moe.use_portlayer_experts(model)


class _TokenStream(torch.nn.Module):
    """forward(input_ids[T], positions[T]) -> logits[T, V] or hidden[T, H]: the flat stream."""

    def __init__(self, model: torch.nn.Module, accepts: set[str], position_offset: int = 0) -> None:
        super().__init__()
        self.model = model
        self.accepts = accepts
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {"input_ids": input_ids[None]}
        if "position_ids" in self.accepts:
            pos = positions + self.position_offset if self.position_offset else positions
            kwargs["position_ids"] = pos[None]
        if "token_type_ids" in self.accepts and getattr(self.model.config, "type_vocab_size", None):
            kwargs["token_type_ids"] = torch.zeros_like(input_ids)[None]
        if "use_cache" in self.accepts:
            kwargs["use_cache"] = False
        out = self.model(**kwargs)
        if hasattr(out, "logits") and out.logits is not None:
            return out.logits[0]
        return out.last_hidden_state[0]


def model_facts(model: torch.nn.Module) -> dict[str, Any]:
    """Model-level facts for graph.meta (read by the policy and the runtime)."""
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    def g(*names: str, default: Any = None) -> Any:
        for n in names:
            v = getattr(text, n, None)
            if v is not None:
                return v
        return default

    hidden = g("hidden_size", "n_embd", "d_model")
    heads = g("num_attention_heads", "n_head")
    kv = g("num_key_value_heads", default=heads)
    head_dim = g("head_dim", default=(hidden // heads if hidden and heads else None))
    archs = list(getattr(cfg, "architectures", None) or [type(model).__name__])
    return {
        "model_type": getattr(cfg, "model_type", type(model).__name__),
        "architectures": archs,
        "num_layers": g("num_hidden_layers", "n_layer"),
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": g("intermediate_size", "n_inner"),
        "vocab_size": g("vocab_size"),
        "max_positions": g("max_position_embeddings", "n_positions", default=4096),
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "eos_token_id": g("eos_token_id"),
        "bos_token_id": g("bos_token_id"),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }


def position_offset(model: torch.nn.Module, accepts: set[str]) -> int:
    """The offset between a token's index in its sequence and the model's position id.

    The flat stream carries 0-based positions. Most models agree; RoBERTa-style models
    number positions from padding_idx + 1. Found by comparing the model's own default
    position ids with explicit ones on a short probe input, so no family is special-cased.
    """
    if "position_ids" not in accepts:
        return 0
    cfg = model.config
    vocab = int(getattr(cfg, "vocab_size", 8) or 8)
    pad = getattr(cfg, "pad_token_id", None)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, 6), generator=gen)
    if pad is not None:
        ids[ids == pad] = (pad + 1) % vocab
    probe = _TokenStream(model, accepts - {"position_ids"}).eval()
    with torch.no_grad():
        default = probe(ids[0], torch.arange(6))
        candidates = [0] + ([int(pad) + 1] if pad is not None else [])
        for off in candidates:
            explicit = _TokenStream(model, accepts, off).eval()(ids[0], torch.arange(6))
            if torch.allclose(default, explicit, atol=1e-5, rtol=1e-4):
                return off
    raise CaptureError(
        f"{type(model).__name__} numbers positions in a way portlayer cannot express as a fixed offset "
        "from the token's index in its sequence; capture is refused rather than silently changing outputs."
    )


def skip_positions(ids: torch.Tensor, skip: int) -> torch.Tensor:
    """0-based positions of a sequence whose model numbers only tokens other than ``skip`` (RoBERTa's
    create_position_ids_from_input_ids: a padding token takes padding_idx, the next token is not shifted by it):
    each other token's index among them, -1 for ``skip`` itself (the graph adds padding_idx + 1)."""
    keep = (ids != skip).long()
    return torch.cumsum(keep, 0) * keep - 1


def position_skip_token(model: torch.nn.Module, accepts: set[str], offset: int) -> int | None:
    """The token id a model leaves out of its position numbering (RoBERTa-style models: their padding id), found
    by probing the model's own default position ids with that token inside a sequence; None when positions are
    the plain index (+ offset) whatever the tokens."""
    pad = getattr(model.config, "pad_token_id", None)
    if "position_ids" not in accepts or pad is None or offset != int(pad) + 1:
        return None
    vocab = int(getattr(model.config, "vocab_size", 8) or 8)
    ids = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(1))
    ids[ids == pad] = (pad + 1) % vocab
    ids[2] = pad
    explicit = _TokenStream(model, accepts, offset).eval()
    with torch.no_grad():
        default = _TokenStream(model, accepts - {"position_ids"}).eval()(ids, torch.arange(6))
        if torch.allclose(default, explicit(ids, torch.arange(6)), atol=1e-5, rtol=1e-4):
            return None
        if torch.allclose(default, explicit(ids, skip_positions(ids, int(pad))), atol=1e-5, rtol=1e-4):
            return int(pad)
    return None


def record_layer_masks(model: torch.nn.Module, accepts: set[str]) -> None:
    """One eager forward that records the mask HF builds for each attention layer (hf_masks)."""
    from portlayer.flatten.hf_masks import recording_masks

    with recording_masks(model), torch.no_grad():
        try:
            _TokenStream(model, accepts).eval()(torch.randint(0, 8, (5,)), torch.arange(5))
        except ValueError as e:
            if "capture is refused" in str(e):
                raise CaptureError(str(e)) from e
            raise
        except (TypeError, AttributeError) as e:  # modeling code that adds the mask to its own scores (ALiBi, ...)
            if "MaskSpec" in str(e):
                raise bypass_error(model, f"its modeling code used the attention mask as a tensor ({e})") from None
            raise


def bypass_error(model: torch.nn.Module, detail: str = "") -> CaptureError:
    """The refusal of a model whose attention does not dispatch through transformers' AttentionInterface."""
    return CaptureError(
        f"{type(model).__name__}'s attention does not go through transformers' AttentionInterface"
        f"{f' ({detail})' if detail else ''}, so portlayer cannot capture it as one attention op (masks and sequence "
        "boundaries would be baked into the graph). Supported are models whose modeling code dispatches attention "
        "through ALL_ATTENTION_FUNCTIONS: Llama, Qwen2/3, Mistral, Gemma 1/2, Phi, Phi-3, StableLM, GPT-NeoX, OPT, "
        "GPT-2, BERT, RoBERTa, ...; ALiBi models (BLOOM, MPT, Falcon with alibi) add their bias to the mask themselves."
    )


def export_token_stream(model: torch.nn.Module, max_tokens: int) -> torch.export.ExportedProgram:
    """torch.export (strict=False) of the flat-stream wrapper with a dynamic token dim."""
    import inspect

    accepts = set(inspect.signature(model.forward).parameters)
    record_layer_masks(model, accepts)
    offset = position_offset(model, accepts)
    # a token left out of the position numbering: graph.meta position_skip_token (_annotate)
    model._portlayer_position_skip = position_skip_token(model, accepts, offset)  # type: ignore[assignment]
    wrapper = _TokenStream(model, accepts, offset).eval()
    n = min(7, max_tokens)
    ids = torch.randint(0, 8, (n,), dtype=torch.long)
    pos = torch.arange(n, dtype=torch.long)
    tokens = torch.export.Dim(TOKEN_SYMBOL, min=1, max=max_tokens)
    try:
        with torch.no_grad():
            return torch.export.export(
                wrapper, (ids, pos), dynamic_shapes=({0: tokens}, {0: tokens}), strict=False
            )
    except Exception as e:  # torch.export raises many types; keep the cause attached
        raise CaptureError(f"torch.export failed for {type(model).__name__}: {export_failure(e)}") from e


def export_failure(e: BaseException) -> str:
    """What a torch.export failure means for a user, in a few lines: the two ways HF modeling code most often
    defeats one program for every token count are named; anything else keeps its first lines."""
    import re

    text = str(e)
    if "Constraints violated" in text:
        guard = re.search(r"satisfy the generated guard (.+?)\.?\s*$", text, re.M)
        return (f"its forward takes a different path for some token counts (torch.export's guard: "
                f"{guard.group(1).strip() if guard else 'see the cause'}), and portlayer captures one program for "
                "every length: not supported; a fix in the modeling code (no branch on the sequence length) would "
                "make it capturable")
    if "data-dependent" in text or "GuardOnDataDependentSymNode" in text:
        expr = re.search(r"data-dependent expression (.+?) \(", text)
        return (f"its forward reads a tensor's value to decide what to compute (data-dependent control flow"
                f"{': ' + expr.group(1) if expr else ''}), which one captured program cannot do: not supported")
    head = "\n".join(text.strip().splitlines()[:6])[:800]
    return (f"{type(e).__name__}: {head}\nportlayer exports HF models through the 'portlayer' attention "
            "implementation; a model whose modeling code bypasses transformers' AttentionInterface or branches on "
            "the sequence length may need attn_implementation='eager' support or a fix upstream.")


def refuse_dynamic_rope(model: torch.nn.Module) -> None:
    """Dynamic NTK rope scaling recomputes the rotary frequencies from the longest position of each forward;
    portlayer's rope reads one fixed table: refused by name (before torch.export fails on it less clearly)."""
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for field in ("rope_scaling", "rope_parameters"):
        rs = getattr(text, field, None)
        if isinstance(rs, dict) and str(rs.get("rope_type") or rs.get("type") or "") == "dynamic":
            raise CaptureError(
                f"{type(model).__name__}: {field} rope_type 'dynamic' (dynamic NTK scaling) recomputes the rotary "
                "frequencies from the longest position in each forward, and portlayer's rope reads one fixed table: "
                f"not supported; set {field} to a static type (linear, yarn, llama3) or none, or keep sequences "
                "under the original max_position_embeddings and drop the scaling")


def capture(
    model: str | os.PathLike[str] | torch.nn.Module,
    *,
    dtype: torch.dtype | None = None,
    raise_patterns: bool = True,
    progress: Callable[[str], None] | None = None,
    verify: bool = True,
    repeat_layers: bool = True,
) -> Graph:
    """Capture an HF model (an nn.Module or a local HF directory) as a Flat IR graph.

    The graph's inputs are ``input_ids`` and ``positions`` ([num_tokens], int64); its
    output is logits [num_tokens, vocab] for causal LMs, the last hidden state
    [num_tokens, hidden] for encoders, or pooled (and normalised) embeddings
    [num_seqs, hidden] for sentence-transformers directories.

    ``verify`` (default) runs flatten/selfcheck.py: the graph against the model's own
    forward at lengths crossing its windows; a mismatch raises SelfCheckError. With it on and
    ``repeat_layers`` (default), a model whose layers are all the same program is exported with
    three layers and the third repeated (flatten/layer_repeat.py; the self-check covers it).
    """
    from portlayer.flatten.patterns import raise_patterns as run_patterns

    say = progress or (lambda _msg: None)
    if isinstance(model, (str, os.PathLike)) and str(model).lower().endswith(".onnx"):  # an ONNX file
        from portlayer.flatten.onnx_import import import_onnx

        say(f"importing ONNX {model}")
        return import_onnx(model, verify=verify)
    st_info: SentenceTransformerInfo | None = None
    source = None
    if isinstance(model, (str, os.PathLike)):
        from portlayer.flatten.builtin_models import resolve_model

        path = resolve_model(str(model))
        source = str(path)
        st_info = _read_sentence_transformer(path)
        say(f"loading {path}")
        module = load_hf_model(path, dtype=dtype)
    elif isinstance(model, torch.nn.Module):
        module = model.eval()
        if dtype is not None:
            module = module.to(dtype)
        _set_attn_impl(module)
    else:
        raise TypeError(f"capture() takes an nn.Module or a path to an HF directory, not {type(model).__name__}")

    refuse_dynamic_rope(module)
    facts = model_facts(module)
    max_tokens = int(facts.get("max_positions") or 4096)
    from portlayer.flatten import layer_repeat

    container = layer_repeat.uniform_layers(module) if (verify and raise_patterns and repeat_layers) else None
    graph = None
    if container:  # identical layers: export three, repeat the third (flatten/layer_repeat.py)
        say(f"exporting {layer_repeat.KEEP} of {facts.get('num_layers')} identical layers with torch.export")
        with layer_repeat.truncated(module, container):
            short = _export_and_convert(module, max_tokens, say)
        _annotate(short, module, facts, source)
        say("raising patterns to portable ops")
        graph = layer_repeat.repeat_layers(run_patterns(short), module, container)
        if graph is None:
            say("the layers' programs differ: exporting every layer")
    if graph is None:
        say("exporting with torch.export")
        graph = _export_and_convert(module, max_tokens, say)
        _annotate(graph, module, facts, source)
        if raise_patterns:
            say("raising patterns to portable ops")
            graph = run_patterns(graph)
    check_missing_weights(module, graph)
    _verify(graph, module, verify, say)
    if st_info is not None and st_info.pooling is not None:
        from portlayer.flatten.pooling import append_pooling

        graph = append_pooling(graph, st_info.pooling, st_info.normalize)
        if st_info.max_seq_length:
            graph.meta["max_seq_length"] = st_info.max_seq_length
    return graph


def _export_and_convert(module: torch.nn.Module, max_tokens: int, say: Callable[[str], None]) -> Graph:
    from portlayer.flatten.from_export import convert_exported_program

    ep = export_token_stream(module, max_tokens=max(max_tokens, 8))
    if not any(getattr(m, "_portlayer_attention_seen", False) for m in module.modules()):
        raise bypass_error(module)
    say("converting to the Flat IR")
    return convert_exported_program(ep, token_symbol=TOKEN_SYMBOL)


def _annotate(graph: Graph, module: torch.nn.Module, facts: dict[str, Any], source: str | None) -> None:
    """Model-level facts in graph.meta (before the pattern rewrites, which read max_positions)."""
    from portlayer.flatten.task import task_of_model

    graph.meta.update(facts)
    graph.meta.update(_kv_facts(graph))
    graph.meta["task"] = task_of_model(module)
    skip = getattr(module, "_portlayer_position_skip", None)  # found with the position offset (export_token_stream)
    if skip is not None:  # the runtime numbers a sequence's positions without this token (runtime/model_runner.py)
        graph.meta["position_skip_token"] = skip
    graph.meta["token_symbol"] = TOKEN_SYMBOL
    if source:
        graph.meta["source"] = source
    if getattr(module, "_portlayer_binding", None):
        graph.meta["weights_binding"] = dict(module._portlayer_binding)


def _verify(graph: Graph, module: torch.nn.Module, verify: bool, say: Callable[[str], None]) -> None:
    """The capture self-check (flatten/selfcheck.py), or a warning that it was skipped."""
    if not verify:
        import warnings

        msg = "capture self-check skipped (--no-verify): the graph was not compared with the model's own forward"
        warnings.warn(msg, stacklevel=3)
        say(msg)
        return
    from portlayer.flatten.selfcheck import self_check

    say("self-check against the model's own forward")
    self_check(graph, module)


def _kv_facts(graph: Graph) -> dict[str, Any]:
    """KV-cache shape from the attention ops themselves (configs disagree: DeepSeek's
    ``head_dim`` is its rope width, its expanded MLA keys are nope + rope wide, values v wide)."""
    attn = graph.find("attention")
    types = graph.value_types()
    shapes = {(types[n.inputs[1]].shape[1], types[n.inputs[1]].shape[2], types[n.inputs[2]].shape[2]) for n in attn}
    if len(shapes) != 1 or not all(isinstance(d, int) for d in next(iter(shapes))):
        return {}
    heads, k_dim, v_dim = next(iter(shapes))
    return {"num_kv_heads": heads, "head_dim": k_dim, "v_head_dim": v_dim}
