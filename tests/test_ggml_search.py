"""llama.cpp's block-parameter searches with an importance matrix, vectorised in quantkit, against
plain per-block loops written line by line from ggml-quants.c (quantize_row_q4_0_impl,
quantize_row_q4_1_impl, quantize_row_q4_K_impl, make_qx_quants, make_qkx3_quants, make_qp_quants),
and what the importance buys GPTQ on a GGUF grid. (scripts/check_gguf_imatrix.py compares the same
grids with llama.cpp's own imatrix quantization of the demo model.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from quantkit.formats.gguf.types import TYPES

f32 = np.float32


def nearest_int(v: float) -> int:
    return int(np.rint(f32(v)))  # ties to even, as the C trick does under the default rounding mode


def ref_make_qx_quants(x, nmax, qw):
    amax_i = int(np.argmax(np.abs(x)))
    vmax = x[amax_i]
    if abs(vmax) < 1e-15:
        return 0.0
    best_scale, best = None, None
    for step in [0] + [s for s in range(-9, 10) if s]:
        iscale = f32(-(nmax + 0.1 * step) / vmax) if step else f32(-nmax / vmax)
        sumlx = suml2 = f32(0)
        for xi, w in zip(x, qw):
            l = max(-nmax, min(nmax - 1, nearest_int(iscale * xi)))
            sumlx += f32(w * xi * l)
            suml2 += f32(w * l * l)
        if step == 0:
            best_scale = sumlx / suml2 if suml2 else f32(0)
            best = best_scale * sumlx
        elif suml2 > 0 and sumlx * sumlx > best * suml2:
            best_scale = sumlx / suml2
            best = best_scale * sumlx
    return float(best_scale)


def ref_make_qkx3_quants(x, nmax, weights, rmin=-0.9, rdelta=0.05, nstep=36):
    lo, hi = min(0.0, float(x.min())), float(x.max())
    if hi <= lo:
        return 0.0, -lo
    sum_w, sum_x = float(weights.sum()), float((weights * x).sum())

    def codes(iscale):
        return np.array([max(0, min(nmax, nearest_int(iscale * (xi - lo)))) for xi in x], dtype=np.float64)

    def err(scale, mn, L):
        return float((weights * (scale * L + mn - x) ** 2).sum())

    scale, mn = (hi - lo) / nmax, lo
    best = err(scale, mn, codes(nmax / (hi - lo)))
    for step in range(nstep + 1):
        L = codes((rmin + rdelta * step + nmax) / (hi - lo))
        sl, sl2, sxl = (weights * L).sum(), (weights * L * L).sum(), (weights * L * x).sum()
        D = sum_w * sl2 - sl * sl
        if D > 0:
            s, m = (sum_w * sxl - sum_x * sl) / D, (sl2 * sum_x - sl * sxl) / D
            if m > 0:
                s, m = sxl / sl2, 0.0
            e = err(s, m, L)
            if e < best:
                best, scale, mn = e, s, m
    return scale, -mn


def ref_make_qp_quants(x, nmax, w):
    vmax = max(x)
    if vmax < 1e-15:
        return 0.0, [0] * len(x)

    def mse(iscale):
        return sum(wi * (xi - min(nmax, nearest_int(iscale * xi)) / iscale) ** 2 for xi, wi in zip(x, w))

    iscale, best = nmax / vmax, mse(nmax / vmax)
    for step in [s for s in range(-4, 5) if s]:
        cand = (0.1 * step + nmax) / vmax
        if mse(cand) < best:
            best, iscale = mse(cand), cand
    L = [min(nmax, nearest_int(iscale * xi)) for xi in x]
    sumlx = sum(wi * xi * li for xi, wi, li in zip(x, w, L))
    suml2 = sum(wi * li * li for wi, li in zip(w, L))
    for _ in range(5):
        changed = 0
        for i, (xi, wi) in enumerate(zip(x, w)):
            slx, sl2 = sumlx - wi * xi * L[i], suml2 - wi * L[i] * L[i]
            if slx > 0 and sl2 > 0:
                new = min(nmax, nearest_int(xi * sl2 / slx))
                if new != L[i]:
                    slx, sl2 = slx + wi * xi * new, sl2 + wi * new * new
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i], sumlx, suml2 = new, slx, sl2
                        changed += 1
        if not changed:
            break
    return (sumlx / suml2 if suml2 > 0 else 0.0), L


def _row_weights(row, imp, sigma2):
    return imp * np.sqrt(sigma2 + row * row)


def _case(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    imp = torch.rand(k, generator=g) ** 4 * 3 + 0.01  # a few columns matter far more, as in real activations
    return w, imp


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1"])
def test_importance_grid_of_32_blocks_is_llama_cpp_impl(name):
    from quantkit.quantizers.gguf_grid import choose_grid

    t = TYPES[name]
    w, imp = _case(6, 128, 1)
    grid = choose_grid(w, t, imp)
    x, q = w.numpy().astype(np.float64), imp.numpy().astype(np.float64)
    same = 0
    for r in range(w.shape[0]):
        sigma2 = (x[r] ** 2).mean()
        for b in range(w.shape[1] // 32):
            xb = x[r, 32 * b:32 * b + 32]
            wb = _row_weights(xb, q[32 * b:32 * b + 32], sigma2)
            if t.zero is not None:
                d, m = ref_make_qx_quants(xb.astype(f32), t.zero, wb.astype(f32)), 0.0
            else:
                d, the_min = ref_make_qkx3_quants(xb, 15, wb)
                m = -the_min
                assert float(grid.offset[r, b]) == pytest.approx(float(np.float16(m)), rel=2e-3, abs=1e-7)
            same += float(grid.scale[r, b]) == float(np.float16(d))
            assert float(grid.scale[r, b]) == pytest.approx(float(np.float16(d)), rel=2e-3)
    assert same >= 0.95 * grid.scale.numel()  # fp16-equal but for float32 summation order


def test_importance_grid_of_k_quants_is_llama_cpp_impl():
    """Q4_K: (scale, min) per 32 by make_qkx3_quants, then 6-bit sub-scales by make_qp_quants weighted
    by each sub-block's summed importance."""
    from quantkit.quantizers.gguf_grid import choose_grid

    t = TYPES["Q4_K"]
    w, imp = _case(3, 512, 2)
    tl = choose_grid(w, t, imp).two_level
    x, q = w.numpy().astype(np.float64), imp.numpy().astype(np.float64)
    agree = total = 0
    for r in range(w.shape[0]):
        for s in range(w.shape[1] // 256):
            xs, qs = x[r, 256 * s:256 * s + 256], q[256 * s:256 * s + 256]
            sigma2 = 2 * (xs ** 2).mean()
            scales, mins, sw = [], [], []
            for j in range(8):
                xb = xs[32 * j:32 * j + 32]
                wb = _row_weights(xb, qs[32 * j:32 * j + 32], sigma2)
                sc, mn = ref_make_qkx3_quants(xb, 15, wb)
                scales.append(sc), mins.append(mn), sw.append(wb.sum())
            d, Ls = ref_make_qp_quants(scales, 63, sw)
            dm, Lm = ref_make_qp_quants(mins, 63, sw)
            assert float(tl.d[r, s]) == pytest.approx(float(np.float16(d)), rel=2e-3)
            assert float(tl.dmin[r, s]) == pytest.approx(float(np.float16(dm)), rel=2e-3, abs=1e-7)
            got_s, got_m = tl.sc[r, 8 * s:8 * s + 8].tolist(), tl.m[r, 8 * s:8 * s + 8].tolist()
            agree += sum(a == max(b, 1) for a, b in zip(got_s, Ls)) + sum(a == b for a, b in zip(got_m, Lm))
            total += 16
    assert agree >= 0.95 * total


def test_qp_quants_matches_its_loop_on_edge_values():
    from quantkit.quantizers.ggml_search import make_qp_quants

    g = torch.Generator().manual_seed(5)
    x = torch.rand(40, 8, generator=g) * torch.rand(40, 1, generator=g)
    x[0] = 0  # an all-zero super-block
    x[1, :7] = 0  # one non-zero sub-scale
    w = torch.rand(40, 8, generator=g) + 0.05
    scale, L = make_qp_quants(x, 63, w)
    for r in range(40):
        ref_scale, ref_L = ref_make_qp_quants(x[r].double().tolist(), 63, w[r].double().tolist())
        assert L[r].tolist() == ref_L
        assert float(scale[r]) == pytest.approx(ref_scale, rel=1e-5, abs=1e-12)


def test_importance_is_checked_and_dead_columns_keep_a_usable_grid():
    from quantkit.quantizers.gguf_grid import choose_grid

    w, imp = _case(4, 64, 3)
    with pytest.raises(ValueError, match="64 finite non-negative"):
        choose_grid(w, TYPES["Q4_0"], imp[:32])
    with pytest.raises(ValueError, match="finite non-negative"):
        choose_grid(w, TYPES["Q4_0"], -imp)
    imp[:32] = 0  # no calibration input ever reached the first block's columns
    grid = choose_grid(w, TYPES["Q4_0"], imp)
    ref = choose_grid(w, TYPES["Q4_0"])
    assert torch.allclose(grid.scale[:, 0], ref.scale[:, 0], rtol=0.5)  # fit to the weights, not d = 0


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])
def test_gptq_with_the_importance_grid_beats_gptq_on_the_reference_grid(name):
    """Activations with a few strong input channels (as real LLM activations have): the grid fit to
    H's diagonal leaves GPTQ a lower output error than llama.cpp's no-imatrix rule."""
    from quantkit.quantizers.gguf_grid import choose_grid
    from quantkit.quantizers.gptq_core import gptq_quantize

    t = TYPES[name]
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 512, generator=g) * 0.02
    channel = torch.rand(512, generator=g) ** 6 * 20 + 0.1
    x = torch.randn(4096, 512, generator=g) * channel
    H = 2 * x.t() @ x / x.shape[0]
    out_err = {}
    for label, importance in (("reference", None), ("importance", torch.diagonal(H))):
        grid = choose_grid(w, t, importance)
        qw, _ = gptq_quantize(grid.shifted(w), H.clone(), t.bits, t.group, t.zero is not None,
                              qparams=(grid.scale, grid.zero))
        out_err[label] = float((x @ (grid.on_grid(qw.qweight).dequantize() - w).t()).square().mean())
    assert out_err["importance"] < 0.9 * out_err["reference"], out_err
