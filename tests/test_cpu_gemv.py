"""kernels.cpu_gemv: the AVX2 int4 and int8 kernels the cpu backend uses at decode sizes.

Oracles: the packing against nibbles read back by hand; the kernel against its plain PyTorch
reference (same arithmetic, fp64 sums: they agree to float32 summation-order error, ~1e-6 of the
output's size, so 1e-5 catches any layout, scale or block error, which are of order 1); the
reference against the exact dequantized ``F.linear`` within the bound that int8 activation rounding
allows (each activation moves by at most half its block's step d, so |error| <= sum |w| * d / 2).
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from quantkit.kernels import c_library, cpu_gemv
from quantkit.quantizers.grid import rtn_quantize
from quantkit.runtime import QuantLinear, backends

AVX2 = sys.platform == "linux" and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = cpu_gemv.CpuGemvKernels(tmp_path_factory.mktemp("cpu-kernels"))
    if not AVX2:
        assert k.lib is None and "AVX2" in k.problem
        pytest.skip(k.problem)
    assert k.problem is None, k.problem  # Linux + AVX2 + gcc (CI's machine): it must build
    return k


def _weights(n, k, gs, sym, seed):
    g = torch.Generator().manual_seed(seed)
    qw = rtn_quantize(torch.randn(n, k, generator=g) * 0.05, 4, gs, sym)
    return qw.qweight, qw.scales, qw.zeros, (k if gs == -1 else gs), g


def test_pack_int4_streams_each_tile_of_8_rows_group_by_group():
    """Tile T, group g: 8 scales and 8 zero offsets (-scale * zero, fp32), then per block b and vector
    L byte 4r + i = row 8T + r's code 32b + 4L + i (low nibble) | code 32b + 16 + 4L + i (high
    nibble); rows past N are zero padding (read back value by value)."""
    n, k, gs = 11, 128, 64
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales, zeros = torch.rand(n, k // gs, generator=g), torch.randint(0, 16, (n, k // gs), generator=g).float()
    packed = cpu_gemv.pack_int4(codes, scales, zeros, gs)
    group_bytes = 64 + (gs // 32) * 128
    assert packed.shape == (2, 2, group_bytes) and packed.dtype == torch.uint8
    for tile in range(2):
        for group in range(2):
            head = packed[tile, group, :64].clone().view(torch.float32).reshape(2, 8)
            body = packed[tile, group, 64:].tolist()
            for r in range(8):
                row = tile * 8 + r
                if row >= n:
                    assert head[:, r].tolist() == [0.0, 0.0]
                    assert all(body[((b * 4 + L) * 8 + r) * 4 + i] == 0 for b in range(2) for L in range(4)
                               for i in range(4))
                    continue
                assert head[0, r] == scales[row, group] and head[1, r] == -scales[row, group] * zeros[row, group]
                for b in range(gs // 32):
                    for L in range(4):
                        for i in range(4):
                            byte = body[((b * 4 + L) * 8 + r) * 4 + i]
                            col = group * gs + b * 32 + 4 * L + i
                            assert (byte & 0xF, byte >> 4) == (int(codes[row, col]), int(codes[row, col + 16]))


def test_pack_int4_refuses_codes_outside_4_bits():
    with pytest.raises(ValueError, match="0..15"):
        cpu_gemv.pack_int4(torch.full((8, 32), 16, dtype=torch.int32), torch.ones(8, 1), torch.zeros(8, 1), 32)


@pytest.mark.parametrize("n,k,gs,sym", [(96, 256, 32, False), (64, 576, 64, True), (37, 384, 128, False),
                                        (48, 1536, -1, False), (50, 192, 64, False)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 17])
def test_kernel_matches_its_reference(kernel, n, k, gs, sym, m):
    """1-4 rows per pass (5, 9, 17: several passes), N a multiple of 8 or not (the last tile's
    padding rows dropped), group sizes 32 to per-channel."""
    codes, scales, zeros, group, g = _weights(n, k, gs, sym, seed=n + k + m)
    x = torch.randn(m, k, generator=g)
    x[0, :32] = 0.0  # an all-zero activation block (scale 0) must give 0, not NaN
    got = kernel.prepare_int4(codes, scales, zeros, group)(x)
    want = cpu_gemv.reference_int4_gemv(x, codes, scales, zeros, group)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("n,k", [(96, 256), (37, 576), (64, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 17])
def test_int8_kernel_matches_its_reference(kernel, n, k, m):
    g = torch.Generator().manual_seed(n + k + m)
    weight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)  # -128 too: |q| = 128 unsigned
    scales = torch.rand(n, 1, generator=g) * 0.01
    x = torch.randn(m, k, generator=g)
    x[-1, 32:64] = 0.0
    got = kernel.prepare_int8(weight, scales)(x)
    want = cpu_gemv.reference_int8_gemv(x, weight, scales)
    assert got.shape == (m, n) and torch.isfinite(got).all()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_int8_reference_is_the_exact_product_up_to_activation_rounding():
    g = torch.Generator().manual_seed(1)
    weight = torch.randint(-127, 128, (32, 128), generator=g, dtype=torch.int8)
    scales = torch.rand(32, 1, generator=g)
    x = torch.randn(3, 128, generator=g)
    w = (weight.double() * scales.double())
    err = (cpu_gemv.reference_int8_gemv(x, weight, scales).double() - x.double() @ w.t()).abs()
    _, d = cpu_gemv.quantize_activations(x)
    bound = (d / 2).expand(-1, -1, 32).reshape(3, 128).double() @ w.abs().t()
    assert (err <= bound * 1.0001 + 1e-6).all() and err.max() > 0


def test_reference_is_the_exact_product_up_to_activation_rounding():
    codes, scales, zeros, group, g = _weights(64, 256, 64, False, seed=3)
    x = torch.randn(4, 256, generator=g) * torch.linspace(0.1, 3.0, 256)
    w = (codes.float() - zeros.float().repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
    exact = x.double() @ w.double().t()
    got = cpu_gemv.reference_int4_gemv(x, codes, scales, zeros, group).double()
    _, d = cpu_gemv.quantize_activations(x)  # [m, K/32, 1]
    half_step = (d / 2).expand(-1, -1, 32).reshape(4, 256).double()
    bound = half_step @ w.abs().double().t()
    err = (got - exact).abs()
    assert (err <= bound * 1.0001 + 1e-6).all()
    assert err.max() > 0  # it does round the activations (this is not the fp32 product)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_activation_poisons_its_row_as_in_pytorch(kernel, bad):
    """fmaxf skips NaN, so without a check a NaN input would vanish into a finite output."""
    codes, scales, zeros, group, g = _weights(32, 128, 64, False, seed=2)
    x = torch.randn(3, 128, generator=g)
    x[1, 70] = bad
    got = kernel.prepare_int4(codes, scales, zeros, group)(x)
    assert got[1].isnan().all() and torch.isfinite(got[[0, 2]]).all()
    assert cpu_gemv.reference_int4_gemv(x, codes, scales, zeros, group)[1].isnan().all()
    w8 = torch.randint(-127, 128, (32, 128), generator=g, dtype=torch.int8)
    got8 = kernel.prepare_int8(w8, torch.rand(32, 1, generator=g))(x)
    assert got8[1].isnan().all() and torch.isfinite(got8[[0, 2]]).all()


def test_rows_do_not_depend_on_the_batch(kernel):
    """Speculative verification (k + 1 rows) must see the same numbers as one-row decode, bit for bit."""
    codes, scales, zeros, group, g = _weights(64, 576, 64, False, seed=9)
    gemv = kernel.prepare_int4(codes, scales, zeros, group)
    x = torch.randn(9, 576, generator=g)
    together = gemv(x)
    for i in range(9):
        assert torch.equal(gemv(x[i:i + 1])[0], together[i])


def test_it_shares_pytorchs_openmp_runtime(kernel):
    """The kernel's threads are PyTorch's own pool only if one OpenMP runtime is mapped (cpu_gemv.c)."""
    runtimes = c_library.openmp_runtimes()
    assert len(runtimes) == 1 and kernel.threads_ok
    assert Path(runtimes.pop()).parent == Path(torch.__file__).parent / "lib"  # PyTorch's own copy


def test_a_second_openmp_runtime_keeps_the_kernel_on_one_thread(kernel, tmp_path, monkeypatch):
    """...with the same numbers: each output is one thread's sum in a fixed order."""
    assert kernel.threads_ok
    monkeypatch.setattr(c_library, "openmp_runtimes", lambda: {"/x/libgomp.so.1", "/y/libiomp5.so"})
    k = cpu_gemv.CpuGemvKernels(tmp_path)
    assert k.problem is None and not k.threads_ok
    codes, scales, zeros, group, g = _weights(32, 128, 64, False, seed=5)
    x = torch.randn(2, 128, generator=g)
    gemv = k.prepare_int4(codes, scales, zeros, group)
    assert torch.equal(gemv(x), kernel.prepare_int4(codes, scales, zeros, group)(x))


def test_a_failed_build_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    if not AVX2:
        pytest.skip("the build is only tried on AVX2")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    k = cpu_gemv.CpuGemvKernels(tmp_path / "build")
    assert k.lib is None and "could not build" in k.problem
    assert not list((tmp_path / "build").glob("*.so"))  # nothing half-written left behind


def test_a_hung_compiler_is_a_reason_not_a_hang(tmp_path, monkeypatch):
    if not AVX2:
        pytest.skip("the build is only tried on AVX2")
    hung = tmp_path / "hung-cc"
    hung.write_text("#!/bin/sh\nsleep 30\n")
    hung.chmod(0o755)
    monkeypatch.setenv("CC", str(hung))
    monkeypatch.setattr(c_library, "BUILD_TIMEOUT_S", 1)
    k = cpu_gemv.CpuGemvKernels(tmp_path / "build")
    assert k.lib is None and "did not finish in 1 s" in k.problem
    assert not list((tmp_path / "build").glob("*.so"))


def _layer(n, k, gs, dtype=torch.float32):
    g = torch.Generator().manual_seed(n + k)
    qw = rtn_quantize(torch.randn(n, k, generator=g) * 0.05, 4, gs, False, bias=torch.randn(n, generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qw, QuantLinear.from_quantized(qw, "gptq", dtype=dtype, backend="cpu")


def test_cpu_backend_takes_the_kernel_up_to_decode_rows(kernel):
    if backends.cpu_decode_kernel() is None:
        pytest.fail("the cpu backend did not get the decode kernel on an AVX2 machine")
    qw, layer = _layer(96, 256, 64)
    gemv = kernel.prepare_int4(qw.qweight, qw.scales, qw.zeros, 64)
    few = torch.randn(backends.DECODE_ROWS, 256)
    assert torch.equal(layer(few), gemv(few) + qw.bias)  # the decode kernel, bias added after
    many = torch.randn(backends.DECODE_ROWS + 1, 256)
    y = layer(many)  # PyTorch's bf16 kernel: not the int8-activation arithmetic
    assert not torch.allclose(y, gemv(many) + qw.bias, rtol=0, atol=1e-6)
    exact = F.linear(many, qw.dequantize(), qw.bias)
    assert ((y - exact).norm() / exact.norm()) < 1e-2


def test_cpu_backend_int8_takes_the_kernel_up_to_decode_rows(kernel):
    g = torch.Generator().manual_seed(4)
    qw = rtn_quantize(torch.randn(64, 256, generator=g) * 0.05, 8, -1, True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = QuantLinear.from_quantized(qw, "compressed-tensors", dtype=torch.float32, backend="cpu")
    gemv = kernel.prepare_int8(qw.signed_int8(), qw.scales)
    few = torch.randn(3, 256, generator=g)
    assert torch.equal(layer(few), gemv(few))
    exact = F.linear(few, qw.dequantize())
    assert ((layer(few) - exact).norm() / exact.norm()) < 1e-2


def test_the_switch_turns_it_off_in_a_fresh_process():
    code = ("import torch; from quantkit.runtime import backends; "
            "print(backends.cpu_decode_kernel() is None)")
    env = {**os.environ, backends.ENV_DECODE_KERNEL: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


# ---- fp32 weights x fp32 activations (F32Gemv): the exact product, batch invariant ----

def _f32_bound(x, w, bias):
    """Rounding bound of the kernel's sum against the exact (fp64) product: each term x_k w_k goes through
    at most ceil(K / 8) FMA roundings in its lane, 3 in the horizontal sum and 1 for the bias, so
    |error| <= gamma_d * (sum_k |x_k w_k| + |b|), d = ceil(K / 8) + 4, gamma_d = d u / (1 - d u), u = 2^-24."""
    d = -(-x.shape[1] // 8) + 4
    u = 2.0 ** -24
    mag = x.double().abs() @ w.double().abs().t()
    if bias is not None:
        mag = mag + bias.double().abs()
    return d * u / (1 - d * u) * mag


@pytest.mark.parametrize("k", [576, 1536, 100, 7])
@pytest.mark.parametrize("n", [1, 3, 5, 64, 963])
@pytest.mark.parametrize("with_bias", [False, True])
def test_f32_kernel_matches_fp64_linear(kernel, k, n, with_bias):
    """Every M from 1 to 17 (the 1-4 row tiles, 5-16 rows in groups of 4 per output tile, 17 = a pass
    of 16 and one of 1; and the one-output tail when N is not a multiple of the tile's width), K not a
    multiple of 8 (the masked last step), against F.linear in fp64 within the summation bound (a
    missing or doubled term, ~|x w|, is far outside it)."""
    g = torch.Generator().manual_seed(k * 7 + n * 3 + with_bias)
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g) if with_bias else None
    gemv = kernel.prepare_f32(w, bias)
    x = torch.randn(17, k, generator=g)
    for m in range(1, 18):
        got = gemv(x[:m])
        assert got.shape == (m, n) and got.dtype == torch.float32
        want = F.linear(x[:m].double(), w.double(), None if bias is None else bias.double())
        assert ((got.double() - want).abs() <= _f32_bound(x[:m], w, bias)).all(), m


@pytest.mark.parametrize("k,with_bias", [(576, True), (100, False), (7, True)])
def test_f32_rows_do_not_depend_on_the_batch(kernel, k, with_bias):
    """Speculative verification: a row's outputs bit for bit the same alone, in any batch of 1 to 16
    rows and at any place in it (so through every tile shape: 1x4, 2x4, 3x3, 4x2, the 5-16 row groups
    and the 1x1 tail, N = 965 leaving 965 % 4, % 3 and % 2 over), and on one thread or two."""
    g = torch.Generator().manual_seed(k)
    n = 965
    w = torch.randn(n, k, generator=g) * 0.05
    gemv = kernel.prepare_f32(w, torch.randn(n, generator=g) if with_bias else None)
    x = torch.randn(16, k, generator=g)
    alone = torch.cat([gemv(x[i:i + 1]) for i in range(16)])
    for m in range(1, 17):
        for shift in range(min(m, 4)):
            rows = (torch.arange(m) + shift * 5) % 16
            assert torch.equal(gemv(x[rows]), alone[rows]), (m, shift)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemv(x), alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("k,where", [(576, 300), (100, 98)])  # 98: in the masked last step
def test_f32_a_non_finite_activation_poisons_only_its_row(kernel, bad, k, where):
    g = torch.Generator().manual_seed(k + where)
    w = torch.randn(37, k, generator=g)
    w[5, where] = 0.0  # inf * 0 is NaN: that output must be NaN, as in PyTorch
    x = torch.randn(5, k, generator=g)
    x[2, where] = bad
    got = kernel.prepare_f32(w, torch.randn(37, generator=g))(x)
    assert torch.isfinite(got[[0, 1, 3, 4]]).all()
    assert not torch.isfinite(got[2]).any()
    want = F.linear(x.double(), w.double())[2]
    assert torch.equal(got[2].isnan(), want.isnan())  # NaN where PyTorch has NaN, and the same infinities
    assert torch.equal(got[2][want.isinf()].double(), want[want.isinf()])


def test_f32_prepare_checks_its_arguments(kernel):
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="bias"):
        kernel.prepare_f32(w, torch.zeros(7))
    with pytest.raises(ValueError, match="2-d"):
        kernel.prepare_f32(torch.randn(2, 8, 16))
    assert kernel.prepare_f32(w).weight.data_ptr() == w.data_ptr()  # an fp32 contiguous weight is not copied
    assert kernel.prepare_f32(w)(torch.zeros(0, 16)).shape == (0, 8)
