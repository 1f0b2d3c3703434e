"""QuantLinear: buffers named as in checkpoints, the reference oracle, and the packed CPU kernels.

Tolerance for the cpu backend: it runs PyTorch's int4/int8 kernels in bf16 (their only vectorised
path), so scales, the tinygemm zero term and the output are rounded to bf16 (unit roundoff
2**-9 ~ 2e-3); the reference in bf16 rounds the dequantized weight and output the same way. Two
such results differ by a few unit roundoffs in relative Frobenius norm (measured ~3e-3), so 1e-2
is tight enough that any layout, permutation or zero-convention bug (errors of order 1) fails.
Up to ``backends.DECODE_ROWS`` rows 4-bit layers take the int8-activation decode kernel instead
(kernels.cpu_gemv): ~5e-3 relative error against the exact product, inside the same 1e-2.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.formats import LinearSpec, get_format
from quantkit.quantizers.grid import rtn_quantize
from quantkit.runtime import QuantLinear
from quantkit.notices import reset_notices
from quantkit.runtime import backends, w8a8

REL_TOL = 1e-2


def make_qw(n, k, bits, gs, sym, seed=0, dynamic=False):
    torch.manual_seed(seed)
    qw = rtn_quantize(torch.randn(n, k) * 0.05, bits, gs, sym, bias=torch.randn(n) * 0.1)
    if dynamic:
        g = k if gs == -1 else gs
        perm = torch.randperm(k)
        qw.g_idx = torch.empty(k, dtype=torch.int32)
        qw.g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
        qw.act_order = "dynamic"
    return qw


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def build(qw, fmt, backend, dtype=torch.bfloat16):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return QuantLinear.from_quantized(qw, fmt, dtype=dtype, backend=backend)


@pytest.fixture(autouse=True)
def _fresh_notices():
    reset_notices()


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors", "awq"])
def test_reference_backend_is_dequantize_then_linear(fmt):
    qw = make_qw(128, 256, 4, 64, False, seed=1)
    m = build(qw, fmt, "reference", dtype=torch.float32)
    x = torch.randn(2, 7, 256)
    assert torch.equal(m(x), F.linear(x, qw.dequantize(torch.float32)) + qw.bias)
    assert m.active_backend == "reference"


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_cpu_int4_matches_reference(gs, sym, dynamic):
    qw = make_qw(192, 384, 4, gs, sym, seed=gs + sym, dynamic=dynamic)
    m = build(qw, "gptq", "cpu")
    x = torch.randn(3, 5, 384, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel path must not fall back
        y = m(x)
    assert m._impl.kernel is not None and y.dtype == torch.bfloat16 and y.shape == (3, 5, 192)
    m.set_backend("reference")
    assert rel_err(y, m(x)) < REL_TOL
    assert rel_err(y, F.linear(x.float(), qw.dequantize(), qw.bias)) < REL_TOL


@pytest.mark.parametrize("fmt,k", [("compressed-tensors", 576), ("awq", 256), ("gptq", 1024)])
def test_cpu_int4_per_channel_and_other_formats(fmt, k):
    """Per-channel (and groups over 256) run as the kernel's largest dividing group, scales repeated."""
    qw = make_qw(96, k, 4, -1, False, seed=k)
    m = build(qw, fmt, "auto")
    x = torch.randn(4, k, dtype=torch.bfloat16)
    y = m(x)
    assert m.active_backend == "cpu" and m._impl.kernel is not None
    assert rel_err(y, F.linear(x.float(), qw.dequantize(), qw.bias)) < REL_TOL


def test_cpu_int8_per_channel_kernel():
    qw = make_qw(160, 256, 8, -1, True, seed=8)
    m = build(qw, "compressed-tensors", "cpu")
    x = torch.randn(6, 256, dtype=torch.bfloat16)
    y = m(x)
    assert m._impl.kernel is not None
    assert rel_err(y, F.linear(x.float(), qw.dequantize(), qw.bias)) < REL_TOL


def test_cpu_output_dtype_follows_input():
    qw = make_qw(128, 256, 4, 32, True)
    m = build(qw, "gptq", "cpu")
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(2, 256, dtype=dtype)
        y = m(x)
        assert y.dtype == dtype
        assert rel_err(y, F.linear(x.float(), qw.dequantize(), qw.bias)) < REL_TOL
    assert m(torch.randn(0, 256)).shape == (0, 128)


@pytest.mark.parametrize("backend,bits,gs,dynamic", [("cpu", 4, 64, False), ("cpu", 4, 32, True), ("cpu", 8, -1, False),
                                                     ("cpu", 3, 64, False), ("reference", 4, 64, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_fn_computes_exactly_what_forward_does(backend, bits, gs, dynamic, dtype):
    """The engine calls layers through ``matmul_fn`` (no module or shape dispatch): bias included,
    act-order permutation included, output in the activations' dtype, the 3-bit fallback included,
    bit for bit the module's own forward."""
    qw = make_qw(96, 256, bits, gs, bits == 8, seed=bits + gs, dynamic=dynamic)
    m = build(qw, "gptq", backend, dtype=dtype)
    x = torch.randn(3, 256).to(dtype)
    y = m.matmul_fn(dtype)(x)
    assert y.dtype == dtype
    assert torch.equal(y, m(x))


@pytest.mark.parametrize("bits,gs,sym,n,why", [(3, 64, True, 96, "3-bit"), (8, -1, False, 96, "symmetric"),
                                               (8, 64, True, 96, "per-channel"), (4, 32, True, 104, "16"),
                                               (2, -1, False, 96, "2-bit")])
def test_cpu_fallbacks_warn_once_and_stay_correct(bits, gs, sym, n, why):
    qw = make_qw(n, 256, bits, gs, sym, seed=bits)
    m = build(qw, "gptq", "cpu")
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match=why):
        y = m(x)
    assert m._impl.kernel is None
    assert torch.equal(y, F.linear(x, qw.dequantize(torch.bfloat16)) + qw.bias.to(torch.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second layer with the same reason stays quiet
        build(qw, "gptq", "cpu")(x)


@pytest.mark.parametrize("fmt,bits,gs,sym,dynamic", [
    ("gptq", 4, 32, True, False),
    ("awq", 4, 64, False, False),  # AWQ layout runs through the one-time repack to gptq
    ("gptq", 4, 32, False, True),  # act-order: rows sorted once, activation columns permuted per call
    ("compressed-tensors", 8, -1, True, False),
])
def test_triton_backend_matches_reference(fmt, bits, gs, sym, dynamic):
    """Under TRITON_INTERPRET=1 (set by conftest without a GPU) the real kernels run on CPU tensors;
    on a GPU (tests/test_gpu.py has the fp16/bf16 cases) on CUDA tensors."""
    from quantkit.kernels import triton_support

    if not triton_support.triton_available():
        pytest.skip("triton cannot run here")
    dev = "cpu" if triton_support.INTERPRET else "cuda"  # on a GPU: real GPU tensors
    qw = make_qw(48, 128, bits, gs, sym, seed=3, dynamic=dynamic)
    m = build(qw, fmt, "triton", dtype=torch.float32).to(dev)
    for rows in (1, 17):
        x = torch.randn(rows, 128).to(dev)
        y = m(x)
        assert m._impl.name == "triton" and m._impl.fallback is None
        expected = F.linear(x, qw.dequantize(torch.float32).to(dev)) + qw.bias.to(dev)
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)


def test_triton_backend_falls_back_with_notice_for_3bit():
    qw = make_qw(96, 128, 3, 32, True)
    m = QuantLinear.from_quantized(qw, "gptq", dtype=torch.float32, backend="triton")
    x = torch.randn(2, 128)
    with pytest.warns(UserWarning, match="triton"):
        y = m(x)
    torch.testing.assert_close(y, F.linear(x, qw.dequantize()) + qw.bias, rtol=1e-5, atol=1e-5)


class Block(nn.Module):
    def __init__(self, spec, fmt, bias):
        super().__init__()
        self.q_proj = QuantLinear(spec, fmt, bias=bias, dtype=torch.float32, backend="cpu")


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors", "awq"])
def test_load_state_dict_fills_buffers_named_as_in_checkpoint(fmt, assign):
    qw = make_qw(128, 256, 4, 64, False, seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = get_format(fmt).pack(qw)
    ckpt = {f"q_proj.{k}": v for k, v in packed.items()}
    ckpt["q_proj.bias"] = qw.bias.clone()
    block = Block(LinearSpec.of(qw), fmt, bias=True)
    assert set(block.state_dict()) == set(ckpt)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    other = build(make_qw(128, 256, 4, 64, False, seed=5), fmt, "cpu")
    block.load_state_dict({f"q_proj.{k}": v for k, v in other.state_dict().items()})
    y_other = block.q_proj(x)  # prepared on the first weights ...
    block.load_state_dict(ckpt, strict=True, assign=assign)  # ... and rebuilt after the next load
    y = block.q_proj(x)
    assert rel_err(y, F.linear(x.float(), qw.dequantize(), qw.bias)) < REL_TOL
    assert rel_err(y_other, y) > 0.1
    back = block.q_proj.quantized_weight()
    assert torch.equal(back.dequantize(), qw.dequantize()) and torch.equal(back.bias, qw.bias)


def test_optional_checkpoint_tensors_have_defaults():
    """An old gptq file without g_idx (no act-order) still loads through a non-strict state dict."""
    qw = make_qw(128, 256, 4, 64, True, seed=9)
    packed = get_format("gptq").pack(qw)
    del packed["g_idx"]
    m = QuantLinear(LinearSpec.of(qw), "gptq", bias=False, dtype=torch.float32, backend="reference")
    missing = m.load_state_dict(packed, strict=False).missing_keys
    assert missing == ["g_idx"]
    x = torch.randn(2, 256)
    assert torch.equal(m(x), F.linear(x, qw.dequantize()))


def test_backend_selection():
    qw = make_qw(96, 128, 4, 32, True)
    m = build(qw, "gptq", "auto")
    m(torch.randn(1, 128, dtype=torch.bfloat16))
    assert m.active_backend == "cpu"
    m.set_backend("reference")
    assert m.active_backend is None  # rebuilt lazily: buffers may still be unloaded
    m(torch.randn(1, 128))
    assert m.active_backend == "reference"
    scales = m.scales.clone()
    m.to(torch.bfloat16)  # casts reach the bias, never the packed checkpoint tensors
    assert m.active_backend is None
    assert m.scales.dtype == torch.float16 and torch.equal(m.scales, scales)
    assert m.bias.dtype == torch.bfloat16 and list(m.state_dict())[:4] == ["qweight", "qzeros", "scales", "g_idx"]
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    assert torch.equal(copy.deepcopy(m)(x), m(x))
    with pytest.raises(QuantkitError, match="backend"):
        m.set_backend("cuda-magic")
    with pytest.raises(QuantkitError, match="features"):
        m(torch.randn(2, 64))


# --- PyTorch's private ops and the optional triton package, feature-detected -----------------------

@pytest.fixture
def fresh_probes():
    backends.cpu_kernel_problem.cache_clear()
    w8a8.int_mm_problem.cache_clear()
    yield
    backends.cpu_kernel_problem.cache_clear()
    w8a8.int_mm_problem.cache_clear()


def hide_aten_ops(monkeypatch, names, replacement=None):
    """Make `torch.ops.aten.<name>` raise AttributeError, as on a PyTorch without the op, or resolve to
    `replacement(real_op)` instead."""
    real = {n: getattr(torch.ops.aten, n) for n in names}
    namespace = type(torch.ops.aten)
    original = namespace.__getattr__

    def lookup(self, op_name):
        if self is torch.ops.aten and op_name in names:
            if replacement is None:
                raise AttributeError(f"'_OpNamespace' 'aten' object has no attribute '{op_name}'")
            return replacement(real[op_name])
        return original(self, op_name)

    for n in names:
        monkeypatch.delattr(torch.ops.aten, n, raising=False)  # the namespace caches resolved ops
    monkeypatch.setattr(namespace, "__getattr__", lookup)


def test_private_ops_pass_their_probe_on_the_tested_torch(fresh_probes):
    assert backends.cpu_kernel_problem(4) is None
    assert backends.cpu_kernel_problem(8) is None
    assert w8a8.int_mm_problem() is None


@pytest.mark.parametrize("bits,gs,op", [(4, 32, "_weight_int4pack_mm_for_cpu"),
                                        (4, 64, "_convert_weight_to_int4pack_for_cpu"),
                                        (8, -1, "_weight_int8pack_mm")])
def test_cpu_backend_without_private_op_uses_reference(monkeypatch, fresh_probes, bits, gs, op):
    hide_aten_ops(monkeypatch, [op])
    qw = make_qw(96, 256, bits, gs, True, seed=bits)
    m = build(qw, "gptq", "cpu")
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match=f"has no torch.ops.aten.{op}"):
        y = m(x)
    assert m._impl.kernel is None
    assert torch.equal(y, F.linear(x, qw.dequantize(torch.bfloat16)) + qw.bias.to(torch.bfloat16))


@pytest.mark.parametrize("bits,gs,op", [(4, 32, "_weight_int4pack_mm_for_cpu"), (8, -1, "_weight_int8pack_mm")])
def test_cpu_backend_with_a_changed_private_op_uses_reference(monkeypatch, fresh_probes, bits, gs, op):
    """An op that exists but computes something else (a changed layout) is caught by the probe."""
    hide_aten_ops(monkeypatch, [op], replacement=lambda real: lambda *args: real(*args).flip(-1))
    qw = make_qw(96, 256, bits, gs, True, seed=bits)
    m = build(qw, "gptq", "cpu")
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="disagrees with the reference"):
        y = m(x)
    assert m._impl.kernel is None
    assert torch.equal(y, F.linear(x, qw.dequantize(torch.bfloat16)) + qw.bias.to(torch.bfloat16))


def test_w8a8_int_mm_missing_falls_back_to_the_exact_fp32_gemm(monkeypatch, fresh_probes):
    qw = make_qw(96, 256, 8, -1, True, seed=8)
    qw.input_quant = {"strategy": "token", "dynamic": True}
    x = torch.randn(5, 256)
    exact = w8a8.W8A8Cpu(qw, torch.device("cpu"), gemm="fp32")(x)
    monkeypatch.delattr(torch, "_int_mm")
    with pytest.warns(UserWarning, match="no torch._int_mm"):
        layer = w8a8.W8A8Cpu(qw, torch.device("cpu"), gemm="int_mm")
    assert layer.gemm == "fp32" and torch.equal(layer(x), exact)


def test_triton_backend_refused_without_the_triton_package(monkeypatch):
    from quantkit.kernels import triton_support

    monkeypatch.setattr(triton_support, "HAS_TRITON", False)
    qw = make_qw(96, 128, 4, 32, True)
    with pytest.raises(QuantkitError, match="triton package.*--backend auto, cpu or reference"):
        QuantLinear.from_quantized(qw, "gptq", dtype=torch.float32, backend="triton")
    assert backends.resolve("auto", torch.device("cpu")) == "cpu"
    with pytest.warns(UserWarning, match="triton is not installed"):
        assert backends.resolve("auto", torch.device("cuda")) == "reference"
    monkeypatch.setattr(triton_support, "HAS_TRITON", True)
    assert backends.resolve("auto", torch.device("cuda")) == "triton"
