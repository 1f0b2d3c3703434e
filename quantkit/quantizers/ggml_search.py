"""llama.cpp's block-parameter searches (ggml-quants.c), vectorised over many blocks at once.

Each function takes a batch of blocks, one per row of `x` [B, n], and returns what its C namesake
returns for each row; the arithmetic is the C code's (trial steps, weighted least squares, the
same acceptance tests, round-half-even like `nearest_int`), only the order of float32 sums differs.
`gguf_grid` composes them into each type's block parameters, with or without an importance matrix.
"""
from __future__ import annotations

import torch

GROUP_MAX_EPS = 1e-15  # ggml-quants.c: a block whose largest |x| is below this is all zero


def make_qkx_quants(x: torch.Tensor, nmax: int, weights: torch.Tensor, rmin: float, rdelta: float, nstep: int):
    """make_qkx2_quants, and make_qkx3_quants with its weights given (the two are the same steps):
    the (scale, min) with the lowest weighted squared error among nstep+1 trial steps, each refit by
    weighted least squares with min <= 0. Returns scale [B] and the positive min [B]
    (value = scale * q - min)."""
    lo = x.amin(-1).clamp(max=0)
    hi = x.amax(-1)
    rng = hi - lo
    flat = rng == 0
    rng = torch.where(flat, torch.ones_like(rng), rng)
    sum_w = weights.sum(-1)
    sum_x = (weights * x).sum(-1)

    def codes(iscale):
        return torch.round(iscale.unsqueeze(-1) * (x - lo.unsqueeze(-1))).clamp_(0, nmax)

    def error(scale, mn, L):
        return (weights * (scale.unsqueeze(-1) * L + mn.unsqueeze(-1) - x).square()).sum(-1)

    best_scale, best_min = rng / nmax, lo
    best_err = error(best_scale, best_min, codes(nmax / rng))
    for step in range(nstep + 1):
        L = codes((rmin + rdelta * step + nmax) / rng)
        sum_l, sum_l2, sum_xl = (weights * L).sum(-1), (weights * L * L).sum(-1), (weights * L * x).sum(-1)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        D = torch.where(ok, D, torch.ones_like(D))
        scale = (sum_w * sum_xl - sum_x * sum_l) / D
        mn = (sum_l2 * sum_x - sum_l * sum_xl) / D
        positive = mn > 0
        mn = torch.where(positive, torch.zeros_like(mn), mn)
        scale = torch.where(positive, sum_xl / sum_l2.clamp(min=1e-30), scale)
        err = error(scale, mn, L)
        better = ok & (err < best_err)
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_min = torch.where(better, mn, best_min)
    best_scale = torch.where(flat, torch.zeros_like(best_scale), best_scale)
    return best_scale, -best_min


def make_qx_quants(x: torch.Tensor, nmax: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """make_qx_quants(rmse_type=1): a signed scale per row (value = scale * l, l in [-nmax, nmax-1])
    fit by weighted least squares over 19 trial steps; the weights are x^2 unless given (llama.cpp's
    `qw`, an importance matrix's per-weight values)."""
    idx = x.abs().argmax(-1, keepdim=True)
    vmax = x.gather(-1, idx).squeeze(-1)
    empty = vmax.abs() < GROUP_MAX_EPS
    vmax = torch.where(empty, torch.ones_like(vmax), vmax)
    w = x * x if weights is None else weights

    def fit(iscale):
        L = torch.round(iscale.unsqueeze(-1) * x).clamp_(-nmax, nmax - 1)
        return (w * x * L).sum(-1), (w * L * L).sum(-1)

    sumlx, suml2 = fit(-nmax / vmax)
    scale = torch.where(suml2 > 0, sumlx / suml2.clamp(min=1e-30), torch.zeros_like(sumlx))
    best = scale * sumlx
    for step in [s for s in range(-9, 10) if s]:
        sumlx, suml2 = fit(-(nmax + 0.1 * step) / vmax)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = torch.where(better, sumlx / suml2.clamp(min=1e-30), scale)
        best = torch.where(better, scale * sumlx, best)
    return torch.where(empty, torch.zeros_like(scale), scale)


def make_qp_quants(x: torch.Tensor, nmax: int, weights: torch.Tensor):
    """make_qp_quants: non-negative values (a super-block's sub-scales or mins) as scale * L with
    integer L in [0, nmax], under per-value weights (each sub-block's summed importance): the best of
    nine trial steps, then up to five rounds of moving single L's while the weighted fit improves.
    Returns scale [B] (the least-squares scale of the final L) and L [B, n] (float, integer values)."""
    vmax = x.amax(-1)
    empty = vmax < GROUP_MAX_EPS
    vmax = torch.where(empty, torch.ones_like(vmax), vmax)

    def codes(iscale):
        return torch.round(iscale.unsqueeze(-1) * x).clamp_(max=nmax)

    def mse(iscale):
        return (weights * (x - codes(iscale) / iscale.unsqueeze(-1)).square()).sum(-1)

    best_iscale = nmax / vmax
    best_mse = mse(best_iscale)
    for step in [s for s in range(-4, 5) if s]:
        iscale = (0.1 * step + nmax) / vmax
        err = mse(iscale)
        better = err < best_mse
        best_mse = torch.where(better, err, best_mse)
        best_iscale = torch.where(better, iscale, best_iscale)
    L = codes(best_iscale)
    sumlx, suml2 = (weights * x * L).sum(-1), (weights * L * L).sum(-1)
    for _ in range(5):
        changed = torch.zeros_like(empty)
        for i in range(x.shape[-1]):  # in order: each move sees the sums left by the previous one
            w, xi, li = weights[:, i], x[:, i], L[:, i]
            slx, sl2 = sumlx - w * xi * li, suml2 - w * li * li
            ok = (slx > 0) & (sl2 > 0)
            new = torch.round(xi * sl2 / torch.where(ok, slx, torch.ones_like(slx))).clamp_(max=nmax)
            slx, sl2 = slx + w * xi * new, sl2 + w * new * new
            take = ok & (new != li) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            L[:, i] = torch.where(take, new, li)
            sumlx, suml2 = torch.where(take, slx, sumlx), torch.where(take, sl2, suml2)
            changed |= take
        if not bool(changed.any()):  # a row that changed nothing this round would change nothing next
            break
    scale = torch.where(suml2 > 0, sumlx / suml2.clamp(min=1e-30), torch.zeros_like(sumlx))
    return torch.where(empty, torch.zeros_like(scale), scale), torch.where(empty.unsqueeze(-1), torch.zeros_like(L), L)
