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

from quantkit.kernels import cpu_gemv
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


def test_pack_int4_puts_code_j_low_and_j_plus_16_high():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = cpu_gemv.pack_int4(codes)
    assert packed.shape == (3, 32) and packed.dtype == torch.uint8
    for row in range(3):
        for block in range(2):
            for j in range(16):
                byte = int(packed[row, block * 16 + j])
                assert byte & 0xF == int(codes[row, block * 32 + j])
                assert byte >> 4 == int(codes[row, block * 32 + 16 + j])


@pytest.mark.parametrize("n,k,gs,sym", [(96, 256, 32, False), (64, 576, 64, True), (37, 384, 128, False),
                                        (48, 1536, -1, False), (50, 192, 64, False)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 17])
def test_kernel_matches_its_reference(kernel, n, k, gs, sym, m):
    """Every tile shape (1x4, 2x4, 3x2, 4x2, and the one-output tail when N % 4 != 0)."""
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
    runtimes = cpu_gemv._openmp_runtimes()
    assert len(runtimes) == 1 and kernel.threads_ok
    assert Path(runtimes.pop()).parent == Path(torch.__file__).parent / "lib"  # PyTorch's own copy


def test_a_second_openmp_runtime_keeps_the_kernel_on_one_thread(kernel, tmp_path, monkeypatch):
    """...with the same numbers: each output is one thread's sum in a fixed order."""
    assert kernel.threads_ok
    monkeypatch.setattr(cpu_gemv, "_openmp_runtimes", lambda: {"/x/libgomp.so.1", "/y/libiomp5.so"})
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
    monkeypatch.setattr(cpu_gemv, "BUILD_TIMEOUT_S", 1)
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
