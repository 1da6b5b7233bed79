"""A CPU **emulator** of the torch_npu / CANN calls the generated Ascend program makes.

This is not Ascend hardware and not torch_npu: it is plain torch on the CPU that mirrors the
documented semantics and the documented constraints of each call, as collected in
../shared/reference/ascend-ops.md (section cited on each method). It exists so that the CANN
op-call program portlayer generates can be run and checked (against HF) on a machine without
an NPU. Every number it produces is an emulation; nothing here was checked on a 910B.

Conventions:
- Math runs in float32; outputs come back in the input dtype (rstd is float32, as documented).
- Rejections raise ``RuntimeError`` in the style of the real stack: op-plugin ``TORCH_CHECK``
  failures as plain messages, CANN (aclnn) failures as ``call aclnnXxx failed, error code is
  561002`` plus an ``E89999`` line (ascend-ops.md, intro / §7). Every message ends with
  ``[ascend emulator]`` so nobody mistakes it for a real device's log.
- Where ascend-ops.md says "unconfirmed" the emulator takes the conservative (stricter) reading
  and says so in a comment (FIA TND head dims, FIA paged block size, negative slots).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

TAG = "[ascend emulator]"
HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
FIA_LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND", "BSH_NBSD", "BSND_NBSD", "BNSD_NBSD", "TND", "TND_NTD", "NTD_TND",
               "BSH_BNSD", "BSND_BNSD", "NTD")
#: conservative reading of the CANN-version-dependent TND head-dim rule (ascend-ops.md §7, PR #9632)
FIA_TND_HEAD_DIMS = (64, 128, 192)
MASK_2048 = 2048


def _check(cond: bool, msg: str) -> None:
    """op-plugin TORCH_CHECK."""
    if not cond:
        raise RuntimeError(f"{msg} {TAG}")


def _cann(cond: bool, api: str, msg: str) -> None:
    """A CANN tiling / parameter rejection (aclnn returns 561002)."""
    if not cond:
        raise RuntimeError(f"call {api} failed, error code is 561002\n[ERROR] E89999: Inner Error! {msg} {TAG}")


def causal_mask_2048(device: torch.device | str = "cpu") -> torch.Tensor:
    """The compressed mask vllm-ascend passes with sparse_mode 2/3: triu(ones(2048, 2048), 1) as int8,
    1 = masked out (attention/attention_mask.py:53)."""
    return torch.triu(torch.ones(MASK_2048, MASK_2048, dtype=torch.int8, device=device), diagonal=1)


class AscendEmulator:
    """Stands in for the ``torch_npu`` module: ``npu.npu_rms_norm(...)`` etc., CPU torch inside.

    ``calls`` counts each API called (tests use it to see that a decode step really went through
    _npu_paged_attention and a prefill through FIA).
    """

    is_emulator = True
    __name__ = "portlayer.backends.ascend_emulator (CPU emulation of torch_npu)"

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self._rope_static: torch.Tensor | None = None  # _npu_rotary_embedding's C++ static (§3)

    def __repr__(self) -> str:
        return "<AscendEmulator: CPU emulation of torch_npu calls, not an NPU>"

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    # ---- §1 npu_rms_norm -------------------------------------------------------------------
    def npu_rms_norm(self, self_: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06):
        self._count("npu_rms_norm")
        x = self_
        _check(gamma.dim() <= x.dim(), f"npu_rms_norm: gamma.dim() {gamma.dim()} > self.dim() {x.dim()}")
        n = x.dim() - gamma.dim()
        _check(tuple(gamma.shape) == tuple(x.shape[n:]),
               f"npu_rms_norm: gamma shape {list(gamma.shape)} must equal the trailing dims of x {list(x.shape)}")
        ok = {(torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
              (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)}
        _cann((x.dtype, gamma.dtype) in ok, "aclnnRmsNorm", f"(x, gamma) dtypes ({x.dtype}, {gamma.dtype}) not supported on A2")
        return self._rms(x, gamma, epsilon)

    # ---- §2 npu_add_rms_norm -----------------------------------------------------------------
    def npu_add_rms_norm(self, x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06):
        self._count("npu_add_rms_norm")
        for name, t in (("x1", x1), ("x2", x2), ("gamma", gamma)):
            _cann(1 <= t.dim() <= 8, "aclnnAddRmsNorm", f"{name} must be 1-8-D, got {t.dim()}-D")
            _cann(t.numel() > 0, "aclnnAddRmsNorm", f"{name} is empty")
        _cann(x1.dtype == x2.dtype == gamma.dtype and x1.dtype in FLOATS, "aclnnAddRmsNorm",
              f"x1, x2, gamma must share one dtype of fp32/fp16/bf16; got {x1.dtype}, {x2.dtype}, {gamma.dtype}")
        _cann(x1.shape == x2.shape, "aclnnAddRmsNorm", f"x1 {list(x1.shape)} and x2 {list(x2.shape)} differ")
        x_sum = (x1.float() + x2.float()).to(x1.dtype)
        y, rstd = self._rms(x_sum, gamma, epsilon)
        return y, rstd, x_sum

    def _rms(self, x: torch.Tensor, gamma: torch.Tensor, eps: float):
        n = x.dim() - gamma.dim()
        _check(n >= 0 and tuple(gamma.shape) == tuple(x.shape[n:]), f"gamma {list(gamma.shape)} must equal the trailing dims "
               f"of x {list(x.shape)}")
        axes = tuple(range(n, x.dim()))
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(dim=axes, keepdim=True) + eps)
        h = xf * rstd
        if x.dtype != torch.float32:  # the normalized row is rounded before gamma, as in HF's Llama/Qwen order
            h = h.to(x.dtype).float()
        return (h * gamma.float()).to(x.dtype), rstd

    # ---- §3 rope -----------------------------------------------------------------------------
    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
        """x [..., rot] float32, cos/sin [..., rot/2] broadcastable: the half / interleave rotation."""
        if neox:
            h = x.shape[-1] // 2
            x1, x2 = x[..., :h], x[..., h:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)

    def _rope_2d(self, positions, x2d, head_size, cache, neox) -> torch.Tensor:
        t = x2d.shape[0]
        rot = cache.shape[-1]
        x = x2d.reshape(t, -1, head_size).float()
        cs = cache[positions.long()].to(x2d.dtype).float()  # the table in the activation dtype
        cos, sin = cs[:, None, : rot // 2], cs[:, None, rot // 2:]
        out = torch.cat((self._rotate(x[..., :rot], cos, sin, neox), x[..., rot:]), dim=-1)
        return out.reshape(t, -1).to(x2d.dtype)

    def npu_rotary_mul(self, self_: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half",
                       rotate: torch.Tensor | None = None) -> torch.Tensor:
        self._count("npu_rotary_mul")
        x = self_
        _check(rotary_mode in ("half", "interleave"), f"npu_rotary_mul: rotary_mode must be 'half' or 'interleave', "
               f"got {rotary_mode!r}")
        _check(x.dim() in (3, 4), f"npu_rotary_mul: x must be 3-D or 4-D, got {x.dim()}-D")
        d = x.shape[-1]
        _cann(d % 2 == 0 and d < 896, "aclnnRotaryPositionEmbedding", f"D={d} must be even and < 896")
        xf, cos, sin = x.float(), r1.to(x.dtype).float(), r2.to(x.dtype).float()  # mixed dtypes: cos/sin cast to x's
        if rotary_mode == "half":
            x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
            rot = torch.cat((-x2, x1), dim=-1)
        else:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
        return (xf * cos + rot * sin).to(x.dtype)

    def _npu_rotary_embedding(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                              cos_sin_cache: torch.Tensor, is_neox_style: bool) -> None:
        """ATB RopeOperation, in place on 2-D q [T, Nq*D] and k [T, Nk*D] (§3)."""
        self._count("_npu_rotary_embedding")
        _check(query.dim() == 2 and key.dim() == 2, f"_npu_rotary_embedding: query/key must be 2-D [T, N*D], got "
               f"{list(query.shape)} / {list(key.shape)}")
        _check(query.shape[1] % head_size == 0 and key.shape[1] % head_size == 0,
               f"_npu_rotary_embedding: head_size {head_size} does not divide {query.shape[1]} / {key.shape[1]}")
        _check(cos_sin_cache.dim() == 2 and cos_sin_cache.shape[-1] % 2 == 0 and cos_sin_cache.shape[-1] <= head_size,
               f"_npu_rotary_embedding: cos_sin_cache must be [max_pos, rot_dim] with even rot_dim <= head_size, got "
               f"{list(cos_sin_cache.shape)}")
        _check(query.is_contiguous() and key.is_contiguous(), "_npu_rotary_embedding: query/key must be contiguous "
               "(written in place)")
        # Quirk (ascend-ops.md §3): ATB caches cos/sin in a C++ static on the FIRST call; later caches are
        # ignored. Emulated: the first table seen by this emulator instance is used for every call.
        if self._rope_static is None:
            self._rope_static = cos_sin_cache.detach().clone()
        cache = self._rope_static
        query.copy_(self._rope_2d(positions, query, head_size, cache, is_neox_style))
        key.copy_(self._rope_2d(positions, key, head_size, cache, is_neox_style))

    def npu_mrope(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
                  head_size: int, *, mrope_section: Sequence[int] | None = None, rotary_mode: str | None = "half",
                  cache_mode: str | None = "default"):
        """aclnnRopeWithSinCosCache: new q, k (§3 npu_mrope). Only plain RoPE (mrope_section [0,0,0]) is emulated."""
        self._count("npu_mrope")
        # The op-plugin source accepts exactly "half"/"interleave"; vllm-ascend HEAD passes "interleaved"
        # (unconfirmed which is right on hardware): the emulator follows the source and rejects it.
        _check(rotary_mode in ("half", "interleave"),
               f"npu_mrope: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
        rot = cos_sin_cache.shape[-1]
        mult = 16 if query.dtype == torch.float32 else 32
        _cann(head_size % mult == 0 and rot % mult == 0, "aclnnRopeWithSinCosCache",
              f"head_size {head_size} and rotary_dim {rot} must be multiples of {mult} for {query.dtype}")
        _check(query.dim() == 2 and key.dim() == 2, "npu_mrope: query/key must be 2-D [T, N*D]")
        _check(query.shape[1] % head_size == 0 and key.shape[1] % head_size == 0, "npu_mrope: head_size does not divide q/k")
        if mrope_section is not None and any(mrope_section):
            raise RuntimeError(f"npu_mrope: M-RoPE sections {list(mrope_section)} are not emulated {TAG}")
        neox = rotary_mode == "half"
        return (self._rope_2d(positions, query, head_size, cos_sin_cache, neox),
                self._rope_2d(positions, key, head_size, cos_sin_cache, neox))

    # ---- §4 npu_swiglu -----------------------------------------------------------------------
    def npu_swiglu(self, self_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self._count("npu_swiglu")
        x = self_
        _cann(1 <= x.dim() <= 8 and x.numel() > 0, "aclnnSwiGlu", f"x must be a non-empty 1-8-D tensor, got {list(x.shape)}")
        _cann(x.is_contiguous(), "aclnnSwiGlu", "x must be contiguous")
        _cann(x.dtype in FLOATS, "aclnnSwiGlu", f"dtype {x.dtype} not in fp32/fp16/bf16")
        _cann(x.shape[dim] % 2 == 0, "aclnnSwiGlu", f"x.shape[{dim}]={x.shape[dim]} must be even")
        a, b = x.float().chunk(2, dim)  # first half = gate (activated), second half = up
        return (a * torch.sigmoid(a) * b).to(x.dtype)

    # ---- §5 KV-cache writes ------------------------------------------------------------------
    def _cache_shapes(self, api, key, value, key_cache, value_cache, slots):
        _check(key_cache.dim() == 4 and value_cache.dim() == 4, f"{api}: caches must be ND [num_blocks, block_size, "
               f"Nkv, D], got {list(key_cache.shape)}")
        _check(key.dim() == 3 and value.dim() == 3, f"{api}: key/value must be [T, Nkv, D], got {list(key.shape)}")
        _check(key.shape[0] == value.shape[0] == slots.shape[0], f"{api}: {key.shape[0]} keys, {value.shape[0]} values, "
               f"{slots.shape[0]} slots")
        _check(tuple(key.shape[1:]) == tuple(key_cache.shape[2:]) and tuple(value.shape[1:]) == tuple(value_cache.shape[2:]),
               f"{api}: key {list(key.shape)} / cache {list(key_cache.shape)} head dims differ")

    def _scatter(self, key, value, key_cache, value_cache, slots) -> None:
        kc = key_cache.view(-1, *key_cache.shape[2:])
        vc = value_cache.view(-1, *value_cache.shape[2:])
        idx = slots.long()
        kc.index_copy_(0, idx, key.to(key_cache.dtype))
        vc.index_copy_(0, idx, value.to(value_cache.dtype))

    def _npu_reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, slot_indices: torch.Tensor) -> None:
        self._count("_npu_reshape_and_cache")
        api = "_npu_reshape_and_cache"
        self._cache_shapes(api, key, value, key_cache, value_cache, slot_indices)
        _check(slot_indices.dtype == torch.int32, f"{api}: slot_indices must be int32, got {slot_indices.dtype}")
        ok = (torch.float16, torch.bfloat16, torch.int8)
        _check(key.dtype == value.dtype == key_cache.dtype == value_cache.dtype and key.dtype in ok,
               f"{api}: key, value and caches must share one dtype of fp16/bf16/int8; got {key.dtype}, {value.dtype}, "
               f"{key_cache.dtype}")
        total = key_cache.shape[0] * key_cache.shape[1]
        # Negative slots are skipped in op-plugin's golden test; hardware behaviour is unconfirmed, so the
        # emulator refuses them (conservative): callers must slice to the real tokens first.
        _check(bool((slot_indices >= 0).all()) and bool((slot_indices < total).all()),
               f"{api}: slots must lie in [0, {total}) (negative slots: hardware behaviour unconfirmed)")
        self._scatter(key, value, key_cache, value_cache, slot_indices)

    def npu_scatter_pa_kv_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                                value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                                compress_lens: torch.Tensor | None = None, compress_seq_offsets: torch.Tensor | None = None,
                                seq_lens: torch.Tensor | None = None, cache_mode: str | None = "PA_NZ") -> None:
        self._count("npu_scatter_pa_kv_cache")
        api = "aclnnScatterPaKvCache"
        if cache_mode != "Norm":
            raise RuntimeError(f"npu_scatter_pa_kv_cache: cache_mode {cache_mode!r} (NZ caches) is not emulated; the "
                               f"generated program passes cache_mode='Norm' (ND caches) {TAG}")
        if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
            raise RuntimeError(f"npu_scatter_pa_kv_cache: compression arguments are not emulated {TAG}")
        self._cache_shapes("npu_scatter_pa_kv_cache", key, value, key_cache, value_cache, slot_mapping)
        _cann(all(t.is_contiguous() for t in (key, value, slot_mapping)), api, "non-contiguous input")
        _cann(slot_mapping.dtype in (torch.int32, torch.int64), api, f"slot_mapping dtype {slot_mapping.dtype}")
        _cann(key.dtype == key_cache.dtype and value.dtype == value_cache.dtype, api,
              f"key {key.dtype} / cache {key_cache.dtype} dtypes differ")
        total = key_cache.shape[0] * key_cache.shape[1]
        _cann(bool((slot_mapping >= 0).all()) and bool((slot_mapping < total).all()), api,
              f"slot_mapping values must lie in [0, {total - 1}]")
        _cann(torch.unique(slot_mapping).numel() == slot_mapping.numel(), api, "slot_mapping has duplicates")
        self._scatter(key, value, key_cache, value_cache, slot_mapping)

    # ---- §6 _npu_paged_attention -------------------------------------------------------------
    def _npu_paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             num_kv_heads: int, num_heads: int, scale_value: float, block_table: torch.Tensor,
                             context_lens: torch.Tensor, out: torch.Tensor, *, workspace: torch.Tensor | None = None) -> None:
        self._count("_npu_paged_attention")
        api = "_npu_paged_attention"
        _check(query.dim() == 3, f"{api}: query must be [B, N, D] (one token per sequence), got {list(query.shape)}")
        _check(query.dtype in HALF, f"{api}: query dtype {query.dtype}; ATB PagedAttention takes fp16/bf16")
        _check(key_cache.dim() == 4 and value_cache.dim() == 4, f"{api}: caches must be ND [num_blocks, block_size, Nkv, D]")
        _check(key_cache.dtype == value_cache.dtype == query.dtype, f"{api}: cache dtype {key_cache.dtype} != query "
               f"{query.dtype}")
        b, n, d = query.shape
        nb, bs, nkv, dk = key_cache.shape
        dv = value_cache.shape[-1]
        _check(n == num_heads and nkv == num_kv_heads, f"{api}: num_heads {num_heads} / num_kv_heads {num_kv_heads} do not "
               f"match query {n} / cache {nkv}")
        _check(num_kv_heads > 0 and num_heads % num_kv_heads == 0, f"{api}: num_heads {num_heads} % num_kv_heads "
               f"{num_kv_heads} != 0")
        _check(bs % 16 == 0, f"{api}: block_size {bs} must be a multiple of 16")
        limit = 256 if dk == dv else 576
        _check(0 < d <= limit and dk == d, f"{api}: head_size {d} must be in (0, {limit}] and equal the cache's {dk}")
        _check(block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == b,
               f"{api}: block_table must be int32 [B={b}, max_blocks], got {block_table.dtype}{list(block_table.shape)}")
        _check(context_lens.device.type == "cpu", f"{api}: context_lens must be on the host (cpu), got {context_lens.device}")
        _check(context_lens.dtype == torch.int32 and tuple(context_lens.shape) == (b,),
               f"{api}: context_lens must be int32 [B={b}], got {context_lens.dtype}{list(context_lens.shape)}")
        _check(tuple(out.shape) == (b, n, dv) and out.dtype == query.dtype, f"{api}: out must be [{b}, {n}, {dv}] "
               f"{query.dtype}, got {out.dtype}{list(out.shape)}")
        lens = context_lens.tolist()
        need = max((-(-c // bs) for c in lens), default=0)
        _check(block_table.shape[1] >= need, f"{api}: max_blocks {block_table.shape[1]} < ceil(max(context_lens)/block_size)"
               f" = {need}")
        group = n // nkv
        for i, c in enumerate(lens):
            _check(c > 0, f"{api}: context_lens[{i}] = {c} must be positive")
            ids = block_table[i, : -(-c // bs)].long()
            _check(bool((ids >= 0).all()) and bool((ids < nb).all()), f"{api}: block ids of sequence {i} outside [0, {nb})")
            k = key_cache[ids].reshape(-1, nkv, dk)[:c].float().repeat_interleave(group, dim=1)
            v = value_cache[ids].reshape(-1, nkv, dv)[:c].float().repeat_interleave(group, dim=1)
            s = torch.einsum("hd,shd->hs", query[i].float(), k) * scale_value  # maskType UNDEFINED: no mask
            out[i] = torch.einsum("hs,shd->hd", torch.softmax(s, dim=-1), v).to(out.dtype)

    # ---- §7 npu_fused_infer_attention_score --------------------------------------------------
    def npu_fused_infer_attention_score(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                                        atten_mask: torch.Tensor | None = None,
                                        actual_seq_lengths: Sequence[int] | None = None,
                                        actual_seq_lengths_kv: Sequence[int] | None = None,
                                        block_table: torch.Tensor | None = None, num_heads: int = 1, scale: float = 1.0,
                                        pre_tokens: int = 2147483647, next_tokens: int = 2147483647,
                                        input_layout: str = "BSH", num_key_value_heads: int = 0, sparse_mode: int = 0,
                                        inner_precise: int = 0, block_size: int = 0, softmax_lse_flag: bool = False,
                                        **unsupported: Any):
        """Only the TND layout (vllm-ascend's path) is emulated; other layouts are validated then refused."""
        self._count("npu_fused_infer_attention_score")
        api = "aclnnFusedInferAttentionScoreV3"
        used = {k: v for k, v in unsupported.items() if v is not None}
        if used:
            raise RuntimeError(f"npu_fused_infer_attention_score: arguments {sorted(used)} (quant / pse / shared prefix / "
                               f"rope split) are not emulated {TAG}")
        _check(input_layout in FIA_LAYOUTS, f"npu_fused_infer_attention_score: input_layout {input_layout!r} is not one of "
               f"{FIA_LAYOUTS}")
        want_dim = {"TND": 3, "BSH": 3, "BSND": 4, "BNSD": 4}.get(input_layout.split("_")[0], 3)
        _check(query.dim() == want_dim, f"npu_fused_infer_attention_score: layout {input_layout} needs a {want_dim}-D "
               f"query, got {query.dim()}-D")
        if input_layout != "TND":
            raise RuntimeError(f"npu_fused_infer_attention_score: layout {input_layout} is not emulated (TND only) {TAG}")
        _cann(query.is_contiguous(), api, "query must be contiguous")
        t, n, d = query.shape
        nkv = num_key_value_heads or num_heads
        _cann(n == num_heads, api, f"num_heads {num_heads} != query heads {n}")
        _cann(n <= 256 and nkv > 0 and n % nkv == 0 and n // nkv <= 64, api,
              f"numHeads {n} / numKeyValueHeads {nkv}: need N <= 256, N % Nkv == 0, ratio <= 64")
        _cann(query.dtype in HALF, api, f"query dtype {query.dtype}: fp16/bf16 only")
        _cann(key.dtype == value.dtype == query.dtype, api, f"q/k/v dtypes {query.dtype}/{key.dtype}/{value.dtype} differ")
        # TND head dim: the set is CANN-version dependent (unconfirmed); conservative reading: 64/128/192.
        _cann(d in FIA_TND_HEAD_DIMS, api, f"When layout is TND, queryD({d}) must be same equal 192/128/64")
        _cann(actual_seq_lengths is not None, api, "When layout is TND, actualSequenceLengthQ is required")
        cum_q = [int(x) for x in actual_seq_lengths]
        _cann(0 < len(cum_q) <= 4096, api, f"actual_seq_lengths has {len(cum_q)} entries (1..4096)")
        _cann(all(b >= a for a, b in zip([0] + cum_q, cum_q)), api, "When layout is TND, actualSequenceLengthQ must be "
              f"cumulative (non-decreasing), got {cum_q}")
        _cann(cum_q[-1] == t, api, f"When layout is TND, queryT({t}) must be equal to the last element of "
              f"actualSequenceLengthQ({cum_q[-1]})")
        _cann(actual_seq_lengths_kv is not None, api, "actual_seq_lengths_kv is required")
        q_lens = [b - a for a, b in zip([0] + cum_q, cum_q)]
        nreq = len(q_lens)
        kvl = [int(x) for x in actual_seq_lengths_kv]
        _cann(len(kvl) == nreq, api, f"B={nreq} (actual_seq_lengths) but {len(kvl)} actual_seq_lengths_kv")
        _check(sparse_mode in (0, 1, 2, 3, 4), f"npu_fused_infer_attention_score: sparse_mode {sparse_mode} is not supported "
               "(5-8 unsupported)")
        if sparse_mode in (2, 3, 4):
            _cann(atten_mask is not None and atten_mask.shape[-2:] == (MASK_2048, MASK_2048) and atten_mask.numel() ==
                  MASK_2048 * MASK_2048, api, f"sparse_mode {sparse_mode} needs the compressed (2048, 2048) mask, got "
                  f"{None if atten_mask is None else list(atten_mask.shape)}")
        if atten_mask is not None:
            _cann(atten_mask.dtype in (torch.bool, torch.int8, torch.uint8), api, f"atten_mask dtype {atten_mask.dtype}")
        if sparse_mode in (2, 3):
            # The hardware reads the compressed mask by tiles; the emulator only knows the canonical
            # triu(ones, 1) one (1 = masked out) and computes the causal rule directly.
            _check(torch.equal(atten_mask.reshape(MASK_2048, MASK_2048).to(torch.int8), causal_mask_2048()),
                   "npu_fused_infer_attention_score: only the canonical triu(ones(2048,2048), 1) mask is emulated")
        if sparse_mode in (1, 4):
            raise RuntimeError(f"npu_fused_infer_attention_score: sparse_mode {sparse_mode} is not emulated {TAG}")

        paged = block_table is not None
        if paged:
            _cann(block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == nreq, api,
                  f"block_table must be int32 [B={nreq}, maxBlocks], got {block_table.dtype}{list(block_table.shape)}")
            _cann(block_size > 0 and block_size % 16 == 0 and block_size <= 512, api,
                  f"block_size {block_size} must be a non-zero multiple of 16, <= 512")
            # The general PA table asks a multiple of 128 when Q_S > 1; the TND section says 16-aligned.
            # Unconfirmed: the emulator takes the stricter rule.
            _cann(max(q_lens) <= 1 or block_size % 128 == 0, api,
                  f"block_size {block_size} must be a multiple of 128 when Q_S > 1 (conservative reading, unconfirmed)")
            if key.dim() == 3:  # (num_blocks, block_size, Nkv*D) BnBsH
                nb = key.shape[0]
                _cann(key.shape[1] == block_size and key.shape[2] % nkv == 0, api, f"key {list(key.shape)} is not "
                      f"(num_blocks, block_size={block_size}, Nkv*D)")
                kc = key.reshape(nb, block_size, nkv, -1)
                vc = value.reshape(nb, block_size, nkv, -1)
            elif key.dim() == 4:  # (num_blocks, Nkv, block_size, D)
                nb = key.shape[0]
                kc, vc = key.transpose(1, 2), value.transpose(1, 2)
            else:
                raise RuntimeError(f"npu_fused_infer_attention_score: {key.dim()}-D (NZ) paged key is not emulated {TAG}")
            _cann(kc.shape[-1] == d, api, f"key head dim {kc.shape[-1]} != query {d}")
            _cann(key.shape == value.shape, api, "key and value shapes differ")
        else:
            _cann(key.dim() == 3 and key.shape[1] == nkv and key.shape[2] == d and key.shape == value.shape, api,
                  f"TND key/value must be (T, Nkv={nkv}, D={d}), got {list(key.shape)} / {list(value.shape)}")
            _cann(all(b >= a for a, b in zip([0] + kvl, kvl)) and kvl[-1] == key.shape[0], api,
                  f"without block_table actual_seq_lengths_kv must be cumulative ending at T_kv={key.shape[0]}, got {kvl}")
        out = torch.empty(t, n, value.shape[-1] if not paged else vc.shape[-1], dtype=query.dtype)
        group = n // nkv
        for r in range(nreq):
            qs, qe = cum_q[r] - q_lens[r], cum_q[r]
            if paged:
                kv_s = kvl[r]
                nblk = -(-kv_s // block_size)
                _cann(block_table.shape[1] >= nblk, api, f"block_table has {block_table.shape[1]} columns, request {r} "
                      f"needs {nblk}")
                ids = block_table[r, :nblk].long()
                _cann(bool((ids >= 0).all()) and bool((ids < nb).all()), api, f"block ids of request {r} out of range")
                k = kc[ids].reshape(-1, nkv, d)[:kv_s]
                v = vc[ids].reshape(-1, nkv, vc.shape[-1])[:kv_s]
            else:
                ks = kvl[r - 1] if r else 0
                k, v = key[ks: kvl[r]], value[ks: kvl[r]]
                kv_s = k.shape[0]
            if qe == qs:
                continue
            qf = query[qs:qe].float()
            kf = k.float().repeat_interleave(group, dim=1)
            vf = v.float().repeat_interleave(group, dim=1)
            s = torch.einsum("lhd,shd->hls", qf, kf) * scale
            q_s = qe - qs
            qi = torch.arange(q_s)[:, None]
            kj = torch.arange(kv_s)[None, :]
            if sparse_mode == 3:  # rightDownCausal: query i sees key j <= i + KV_S - Q_S
                allowed = kj <= qi + kv_s - q_s
            elif sparse_mode == 2:  # leftUpCausal
                allowed = kj <= qi
            elif atten_mask is not None:  # sparse_mode 0: a full mask, 1 = masked out
                allowed = atten_mask.reshape(atten_mask.shape[-2], atten_mask.shape[-1])[:q_s, :kv_s] == 0
            else:
                allowed = torch.ones(q_s, kv_s, dtype=torch.bool)
            s = s.masked_fill(~allowed[None], float("-inf"))
            p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
            out[qs:qe] = torch.einsum("hls,shd->lhd", p, vf).to(query.dtype)
        # torch-npu 2.14.0's meta function: without softmax_lse_flag the lse output is an empty [0] float32
        # (ascend-ops.md said shape (1,); the wheel settles it, tests/test_ascend_conformance.py)
        lse = torch.empty(0, dtype=torch.float32)
        if softmax_lse_flag:
            raise RuntimeError(f"npu_fused_infer_attention_score: softmax_lse_flag=True is not emulated {TAG}")
        return out, lse


    # ---- grouped matmul (MoE experts; torch_npu >= 7.0 docs, not yet in ascend-ops.md) --------------
    def npu_grouped_matmul(self, x: list, weight: list, *, bias: list | None = None, group_list: Any = None,
                           split_item: int = 0, group_type: int | None = None, group_list_type: int = 0,
                           output_dtype: Any = None, **quant: Any) -> list:
        """The single-tensor form MoE uses: x = [rows [M, K]] sorted by group, weight = [W [E, K, N]],
        group_list = int64 [E] (cumulative ends with group_list_type 0, counts with 1), group_type 0
        (split along M), split_item 2/3 (one output [M, N]). Other forms are not emulated."""
        self._count("npu_grouped_matmul")
        api = "aclnnGroupedMatmulV4"
        _check(not any(v is not None for v in (bias, *quant.values())), f"{api}: bias / quantization not emulated")
        _check(len(x) == 1 and len(weight) == 1 and x[0].dim() == 2 and weight[0].dim() == 3,
               f"{api}: only x=[2-D], weight=[3-D] is emulated")
        _check(group_type == 0 and split_item in (2, 3), f"{api}: only group_type=0, split_item 2/3 is emulated")
        a, w = x[0], weight[0]
        _cann(a.dtype == w.dtype and a.dtype in FLOATS, api, f"x {a.dtype} and weight {w.dtype} must be one float dtype")
        _cann(a.shape[1] == w.shape[1], api, f"x [M, {a.shape[1]}] does not match weight [E, {w.shape[1]}, N]")
        gl = torch.as_tensor(group_list).long()
        _check(gl.dim() == 1 and gl.numel() == w.shape[0], f"{api}: group_list must hold one entry per group")
        ends = gl if group_list_type == 0 else torch.cumsum(gl, 0)
        _cann(bool((ends[1:] >= ends[:-1]).all()) and int(ends[-1]) <= a.shape[0], api,
              "group_list must be non-decreasing and end within x's rows")
        out = torch.zeros(a.shape[0], w.shape[2], dtype=output_dtype or a.dtype)
        start = 0
        for e, end in enumerate(ends.tolist()):
            if end > start:
                out[start:end] = (a[start:end].float() @ w[e].float()).to(out.dtype)
            start = end
        return [out]
