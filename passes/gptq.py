"""GPTQ (Frantar et al., 2022): quantize a weight column by column, pushing each column's
rounding error onto the columns not yet quantized, weighted by the inverse Hessian of the
layer's inputs (H = 2 X^T X from calibration activations).

The output is the ``linear_wq`` contract: codes q, and per group of ``group_size`` input
columns a float32 scale (and, asymmetric, an offset) so that ``w ~= q * scale + offset``.
A group's scale/offset is fixed when the sweep reaches its first column (the "static
groups off" variant of the reference implementation), from the error-updated weights, with
a small clip search (the scale among a few shrink ratios with the least squared error).
"""

from __future__ import annotations

import torch

CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8)
REFIT_STEPS = 2  # least-squares scale/offset refits after the output-error clip search


def group_params(w: torch.Tensor, bits: int, symmetric: bool,
                 h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale [R], offset [R] or None) for groups w [R, G], the clip ratio chosen per group.

    Without ``h`` the ratio has the least squared weight error. With ``h`` ([ng, G, G]: the input
    Gram block of each of the ng groups of a row, rows of ``w`` ordered row-major over them) it has
    the least output error ``dw h dw^T`` on the calibration inputs, and asymmetric groups shrink
    their minimum and maximum independently (AWQ's clip search on the layer's real output)."""
    qmax = 2 ** (bits - 1) - 1
    w = w.float()
    pairs = [(r, r) for r in CLIP_RATIOS] if h is None or symmetric else [(a, b) for a in CLIP_RATIOS for b in CLIP_RATIOS]
    best = None
    for ra, rb in pairs:
        if symmetric:
            s = (w.abs().amax(1) * ra / qmax).clamp_min(1e-10)
            off = None
            q = torch.round(w / s[:, None]).clamp(-qmax - 1, qmax)
            d = q * s[:, None] - w
        else:
            lo, hi = w.amin(1) * ra, w.amax(1) * rb
            s = ((hi - lo) / (2 * qmax + 1)).clamp_min(1e-10)
            off = lo + (qmax + 1) * s  # q = u - (qmax+1): w = s*u + lo = s*q + off
            q = torch.round((w - off[:, None]) / s[:, None]).clamp(-qmax - 1, qmax)
            d = q * s[:, None] + off[:, None] - w
        err = _err(d, h)
        if best is None:
            best = [s, off, err]
        else:
            better = err < best[2]
            best[0] = torch.where(better, s, best[0])
            if off is not None:
                best[1] = torch.where(better, off, best[1])
            best[2] = torch.minimum(err, best[2])
    if h is not None:
        for _ in range(REFIT_STEPS):
            _refit(w, best, h, qmax)
    return best[0], best[1]


def _err(d: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    if h is None:
        return (d ** 2).sum(1)
    dg = d.reshape(-1, h.shape[0], h.shape[1])
    return torch.einsum("rgi,gij,rgj->rg", dg, h, dg).reshape(-1)


def _refit(w: torch.Tensor, best: list, h: torch.Tensor, qmax: int) -> None:
    """One least-squares step in the output metric: for the current codes, the scale (and offset)
    minimising ``dw h dw^T`` (a 1x1 / 2x2 solve per group), kept per group only where the codes
    re-rounded on the new grid lower the error."""
    s, off, err = best
    base = off[:, None] if off is not None else 0.0
    q = torch.round((w - base) / s[:, None]).clamp(-qmax - 1, qmax)
    r, gs = w.shape
    ng = h.shape[0]

    def hmul(v: torch.Tensor) -> torch.Tensor:  # each row times its group's h
        return torch.einsum("rgj,gij->rgi", v.reshape(-1, ng, gs), h).reshape(r, gs)

    hq, hw = hmul(q), hmul(w)
    if off is None:
        ns, no = (q * hw).sum(1) / (q * hq).sum(1).clamp_min(1e-20), None
    else:
        h1 = hmul(torch.ones_like(w))  # h @ 1
        a, b, c = (q * hq).sum(1), (q * h1).sum(1), h1.sum(1)
        y0, y1 = (q * hw).sum(1), hw.sum(1)
        det = a * c - b * b
        ok = det.abs() > 1e-12 * (a * c).abs().clamp_min(1e-30)
        ns = torch.where(ok, (c * y0 - b * y1) / torch.where(ok, det, 1.0), s)
        no = torch.where(ok, (a * y1 - b * y0) / torch.where(ok, det, 1.0), off)
    ns = torch.where(ns > 1e-10, ns, s)
    nb = no[:, None] if no is not None else 0.0
    nq = torch.round((w - nb) / ns[:, None]).clamp(-qmax - 1, qmax)
    nerr = _err(nq * ns[:, None] + nb - w, h)
    better = nerr < err
    best[0] = torch.where(better, ns, s)
    if off is not None:
        best[1] = torch.where(better, no, off)
    best[2] = torch.minimum(nerr, err)


def gram_blocks(gram: torch.Tensor, rows: int, group_size: int) -> torch.Tensor:
    """[K/g, g, g] float32: the diagonal blocks of the input Gram matrix, one per group of columns."""
    k = gram.shape[0]
    ng = k // group_size
    idx = torch.arange(k, device=gram.device).reshape(ng, group_size)
    return (gram[idx[:, :, None], idx[:, None, :]] / max(rows, 1)).float()


def rtn(w: torch.Tensor, bits: int, group_size: int, symmetric: bool,
        h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest with the same per-group clip search, vectorized (GPTQ with H = I);
    ``h`` (gram_blocks) makes the search grade the output error on calibration inputs."""
    n, k = w.shape
    qmax = 2 ** (bits - 1) - 1
    wg = w.detach().float().reshape(n * (k // group_size), group_size)
    s, off = group_params(wg, bits, symmetric, h)
    base = off[:, None] if off is not None else 0.0
    q = torch.round((wg - base) / s[:, None]).clamp(-qmax - 1, qmax).to(torch.int8).reshape(n, k)
    ng = k // group_size
    return q, s.reshape(n, ng), off.reshape(n, ng) if off is not None else None


def gptq(w: torch.Tensor, gram: torch.Tensor, rows: int, bits: int, group_size: int, symmetric: bool,
         damp: float = 0.01, block: int = 64, act_order: bool = False,
         clip_output: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q int8 [N, K], scales [N, K/g], offsets [N, K/g] or None) of weight ``w`` [N, K].

    ``act_order``: sweep the columns by decreasing Hessian diagonal (the most active inputs
    first, while the most columns are left to absorb their error); the groups stay contiguous
    columns as the kernels want, so their scales are fixed up front from the float weight
    ("static groups"). ``clip_output``: each group's scale/offset is chosen on its output error
    under its block of H (group_params with ``h``), not on the squared weight error."""
    W = w.detach().float().to(gram.device).clone()
    n, k = W.shape
    qmax = 2 ** (bits - 1) - 1
    H = 2 * gram.double() / max(rows, 1)
    if k % group_size:
        raise ValueError(f"gptq: K={k} is not a multiple of group_size={group_size}")
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.mean(torch.diag(H)) * torch.eye(k, dtype=H.dtype, device=H.device)

    def hblock(j: int) -> torch.Tensor | None:
        return H[j:j + group_size, j:j + group_size].float()[None] if clip_output else None

    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k, device=H.device)
    static = None
    if act_order:
        static = [group_params(W[:, j:j + group_size], bits, symmetric, hblock(j)) for j in range(0, k, group_size)]
        W, H = W[:, perm], H[perm][:, perm]
    L = torch.linalg.cholesky(H)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).float()
    Q = torch.zeros(n, k, dtype=torch.int8, device=W.device)
    ng = k // group_size
    scales = torch.zeros(n, ng, dtype=torch.float32, device=W.device)
    offsets = None if symmetric else torch.zeros(n, ng, dtype=torch.float32, device=W.device)
    order = perm.tolist()  # host ints: no device sync per column
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1 = W[:, i1:i2].clone()
        E = torch.zeros_like(W1)
        Hb = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = order[i1 + i]
            if static is not None:
                g = col // group_size
                scales[:, g] = static[g][0]
                if offsets is not None:
                    offsets[:, g] = static[g][1]
            elif col % group_size == 0:
                g = col // group_size
                grp = torch.cat([W1[:, i:], W[:, i2:]], 1)[:, :group_size]
                s, off = group_params(grp, bits, symmetric, hblock(col))
                scales[:, g] = s
                if offsets is not None:
                    offsets[:, g] = off
            g = col // group_size
            s = scales[:, g]
            off = offsets[:, g] if offsets is not None else 0.0
            x = W1[:, i]
            q = torch.round((x - off) / s).clamp(-qmax - 1, qmax)
            Q[:, col] = q.to(torch.int8)
            err = (x - (q * s + off)) / Hb[i, i]
            W1[:, i:] -= err[:, None] * Hb[i, i:][None, :]
            E[:, i] = err
        W[:, i2:] -= E @ Hinv[i1:i2, i2:]
    return Q, scales.float(), offsets.float() if offsets is not None else None
