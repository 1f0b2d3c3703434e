"""Triton kernels vs their PyTorch references (and the references vs hand-written loops).

Without a GPU the kernels run in Triton's CPU interpreter, which triton selects when a kernel is
*decorated*, i.e. when ``quantkit.kernels`` is first imported. So the variable is set here, at the
very top, before anything imports the kernels. If another test module imports ``quantkit.kernels``
earlier in the same pytest process without it, the check below fails loudly instead of silently
comparing the CPU fallback with itself; the fix is to set the variable in ``tests/conftest.py``.
With a CUDA device (and TRITON_INTERPRET unset) the compiled, autotuned kernels are tested on the
GPU instead, bf16 included.
"""
import os

import torch  # does not import triton

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]

TS = importlib.import_module("quantkit.kernels.triton_support")
R = importlib.import_module("quantkit.kernels.reference")
DG = importlib.import_module("quantkit.kernels.dequant_gemm")
I8 = importlib.import_module("quantkit.kernels.int8_gemm")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernels_active():
    """Kernel tests must really run Triton (compiled on CUDA or interpreted on CPU)."""
    if not DG.HAS_TRITON:
        pytest.skip("triton is not installed; only the references are tested")
    if DEVICE == "cpu" and not (DG.INTERPRET and I8.INTERPRET):
        pytest.fail(
            "quantkit.kernels was imported before TRITON_INTERPRET=1 was set, so the kernels "
            "would silently fall back to the references; set it in tests/conftest.py"
        )


# ----------------------------------------------------------------------------------------------
# helpers


def _make_gptq(k, n, bits, group_size, sym, act_order, seed):
    """Random GPTQ v1 tensors plus the ground truth codes / zeros / g_idx they encode."""
    g = torch.Generator().manual_seed(seed)
    gs = k if group_size == -1 else group_size
    n_groups = k // gs
    codes = torch.randint(0, 2**bits, (k, n), generator=g, dtype=torch.int32)
    scales = (torch.rand(n_groups, n, generator=g) * 0.02 + 0.002).half()
    if sym:
        zeros = torch.full((n_groups, n), 2 ** (bits - 1), dtype=torch.int32)
        qzeros = None
    else:
        zeros = torch.randint(0, 2**bits, (n_groups, n), generator=g, dtype=torch.int32)
        qzeros = R.pack_gptq_qzeros(zeros, bits)
    if act_order:
        # what GPTQ desc_act produces: every group has exactly gs rows, scattered over K
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=g)] = (torch.arange(k) // gs).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // gs).to(torch.int32)
    return dict(
        qweight=R.pack_gptq_qweight(codes, bits), scales=scales, qzeros=qzeros, g_idx=g_idx,
        codes=codes, zeros=zeros,
    )


def _dense_from_truth(t, bits):
    """W from the generating codes/zeros, bypassing every unpack routine."""
    gi = t["g_idx"].long()
    return t["scales"].float()[gi] * (t["codes"] - t["zeros"][gi]).float()


def _to(t, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in t.items()}


def _max_rel_err(y, ref):
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


# ----------------------------------------------------------------------------------------------
# references vs independent loops


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_qweight_matches_python_loop(bits):
    pf, mask = 32 // bits, (1 << bits) - 1
    qw = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32)
    qw[0, 0] = -1  # all ones, sign bit set
    qw[1, 1] = -(2**31)  # only the sign bit
    codes = R.unpack_gptq_qweight(qw, bits)
    assert codes.shape == (3 * pf, 5)
    for r in range(3):
        for n in range(5):
            word = int(qw[r, n]) & 0xFFFFFFFF
            for j in range(pf):
                assert int(codes[r * pf + j, n]) == (word >> (bits * j)) & mask


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_qzeros_matches_python_loop(bits):
    pf, mask = 32 // bits, (1 << bits) - 1
    qz = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32)
    z = R.unpack_gptq_qzeros(qz, bits)
    assert z.shape == (2, 3 * pf)
    for gr in range(2):
        for c in range(3):
            word = int(qz[gr, c]) & 0xFFFFFFFF
            for j in range(pf):
                assert int(z[gr, c * pf + j]) == (((word >> (bits * j)) & mask) + 1) & mask


def test_pack_roundtrip_and_symmetric_v1_words():
    for bits in (4, 8):
        codes = torch.randint(0, 2**bits, (64, 24), dtype=torch.int32)
        assert torch.equal(R.unpack_gptq_qweight(R.pack_gptq_qweight(codes, bits), bits), codes)
        zeros = torch.randint(0, 2**bits, (2, 24), dtype=torch.int32)
        assert torch.equal(R.unpack_gptq_qzeros(R.pack_gptq_qzeros(zeros, bits), bits), zeros)
    # symmetric 4-bit: zero 8 is stored as 7 in every nibble -> 0x77777777 (formats reference)
    qz = R.pack_gptq_qzeros(torch.full((1, 8), 8, dtype=torch.int32), 4)
    assert int(qz[0, 0]) == 0x77777777


@pytest.mark.parametrize("sym,act_order", [(False, False), (True, True)])
def test_w4a16_reference_matches_truth(sym, act_order):
    t = _make_gptq(128, 24, 4, 32, sym, act_order, seed=1)
    x = torch.randn(5, 128)
    ref = R.w4a16_reference(x, t["qweight"], t["scales"], t["qzeros"], t["g_idx"], 4)
    torch.testing.assert_close(ref, x @ _dense_from_truth(t, 4), rtol=1e-5, atol=1e-5)
    if not act_order:  # g_idx=None: contiguous groups, size inferred from the scale rows
        torch.testing.assert_close(R.w4a16_reference(x, t["qweight"], t["scales"], t["qzeros"], None, 4), ref)


def test_quantize_per_token_reference_rounds_half_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5], [0.0] * 8])
    q, s = R.quantize_per_token_int8(x)
    assert q[0].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    assert s.flatten().tolist() == [1.0, 0.0] and q[1].abs().sum() == 0


# ----------------------------------------------------------------------------------------------
# dequant_gemm (W4A16 / W8A16)

# (M, K, N, bits, group, sym, dtype, act_order). With the interpreter's BLOCK_K=64: group 32 and
# K=160/200 take the per-row scale path + K masks, 64/128/per-channel the per-block path; N=48/72
# are not multiples of BLOCK_N=32; M <= 16 is split-K (1 -> tl.sum GEMV, 3 and 16 -> tl.dot).
DQ_CASES = [
    (1, 256, 72, 4, 32, False, torch.float16, False),
    (1, 128, 48, 8, -1, False, torch.float32, False),
    (3, 192, 48, 8, 64, True, torch.float32, False),
    (3, 256, 72, 4, 64, False, torch.float16, True),
    (16, 256, 72, 4, 128, False, torch.float16, False),
    (16, 128, 48, 4, 32, True, torch.float32, True),
    (17, 200, 48, 4, -1, False, torch.float32, False),
    (17, 160, 72, 8, 32, True, torch.float16, False),
    (64, 256, 72, 4, 32, True, torch.float16, False),
    (64, 192, 48, 8, 64, False, torch.float16, True),
    (64, 128, 48, 4, 128, False, torch.float32, False),
]
if DEVICE == "cuda" and not DG.INTERPRET:  # bf16 is silently wrong in the interpreter
    DQ_CASES += [(1, 256, 72, 4, 128, False, torch.bfloat16, False),
                 (64, 256, 72, 4, 32, True, torch.bfloat16, True)]


def _tol(dtype):
    # the kernel feeds tl.dot with W cast to x's dtype; the reference keeps W in fp32
    return {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]


@pytest.mark.parametrize("m,k,n,bits,group,sym,dtype,act_order", DQ_CASES)
def test_dequant_gemm_matches_reference(kernels_active, m, k, n, bits, group, sym, dtype, act_order):
    t = _to(_make_gptq(k, n, bits, group, sym, act_order, seed=m * 1000 + k + n), DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    ref = R.w4a16_reference(x, t["qweight"], t["scales"], t["qzeros"], t["g_idx"], bits, group)
    y = DG.dequant_gemm(x, t["qweight"], t["scales"], t["qzeros"], t["g_idx"], bits, group)
    assert y.shape == (m, n) and y.dtype == dtype
    assert _max_rel_err(y, ref) < _tol(dtype)


def test_dequant_gemm_prepared_act_order_and_batch_dims(kernels_active):
    """The load-time path: sort once, pass perm; x with leading batch dims (M = 2 * 3)."""
    t = _to(_make_gptq(128, 48, 4, 32, False, True, seed=7), DEVICE)
    qw_s, g_s, perm = DG.prepare_act_order(t["qweight"], t["g_idx"], 4)
    assert torch.equal(g_s.long().cpu(), torch.arange(128) // 32)  # contiguous groups
    assert torch.equal(R.unpack_gptq_qweight(qw_s, 4), R.unpack_gptq_qweight(t["qweight"], 4)[perm])
    x = torch.randn(2, 3, 128).to(DEVICE, torch.float16)
    ref = R.w4a16_reference(x, t["qweight"], t["scales"], t["qzeros"], t["g_idx"], 4)
    y = DG.dequant_gemm(x, qw_s, t["scales"], t["qzeros"], None, 4, 32, perm=perm)
    assert y.shape == (2, 3, 48)
    assert _max_rel_err(y, ref) < _tol(torch.float16)
    y2 = DG.dequant_gemm(x[0, :1], qw_s, t["scales"], t["qzeros"], g_s, 4, 32, perm=perm)  # M=1
    assert _max_rel_err(y2, ref[0, :1]) < _tol(torch.float16)
    with pytest.raises(ValueError, match="group_size rows"):  # unsorted g_idx with a perm
        DG.dequant_gemm(x, qw_s, t["scales"], t["qzeros"], t["g_idx"], 4, 32, perm=perm)


def test_dequant_gemm_rejects_bad_shapes():
    t = _make_gptq(192, 16, 4, 64, False, False, seed=3)
    x = torch.randn(2, 192)
    with pytest.raises(ValueError, match="multiple of group_size"):
        DG.dequant_gemm(x, t["qweight"], t["scales"][:1], t["qzeros"][:1], None, 4, 128)
    with pytest.raises(ValueError, match="pack factor"):
        DG.dequant_gemm(torch.randn(2, 36), t["qweight"], t["scales"], t["qzeros"], None, 4, 64)
    with pytest.raises(ValueError, match="bits"):
        DG.dequant_gemm(x, t["qweight"], t["scales"], t["qzeros"], None, 3, 64)
    with pytest.raises(ValueError, match="scales must be"):
        DG.dequant_gemm(x, t["qweight"], t["scales"][:2], t["qzeros"], None, 4, 64)
    bad = t["g_idx"].clone()
    bad[0] = 1  # group 1 now has 65 rows
    with pytest.raises(ValueError, match="group_size rows"):
        DG.dequant_gemm(x, t["qweight"], t["scales"], t["qzeros"], bad, 4, 64)


# ----------------------------------------------------------------------------------------------
# W8A8


@pytest.mark.parametrize("m,k,dtype", [(1, 128, torch.float16), (3, 72, torch.float32),
                                       (17, 200, torch.float16), (2, 5000, torch.float32)])
def test_per_token_quant_matches_reference_exactly(kernels_active, m, k, dtype):
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3).to(dtype)
    if m >= 3:
        x[1] = 0.0  # all-zero row: scale 0, codes 0
        x[2, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -127.0])
        x[2, 8:] = 0.25
    x = x.to(DEVICE)
    q, s = I8.per_token_quant_int8(x)
    q_ref, s_ref = R.quantize_per_token_int8(x)
    assert q.dtype == torch.int8 and q.shape == (m, k) and s.shape == (m, 1) and s.dtype == torch.float32
    assert torch.equal(s, s_ref)
    assert torch.equal(q, q_ref)
    if m >= 3:
        assert q[2, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, -127]


@pytest.mark.parametrize("m,k,n,bias,out_dtype", [
    (1, 128, 48, True, torch.float16),
    (3, 192, 72, False, torch.float32),
    (16, 256, 48, True, torch.float32),
    (17, 200, 72, True, torch.float16),  # K not a multiple of BLOCK_K=32
    (64, 128, 72, False, torch.float16),
])
def test_int8_gemm_matches_reference(kernels_active, m, k, n, bias, out_dtype):
    g = torch.Generator().manual_seed(m + k + n)
    x_q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    x_q[0, :4] = torch.tensor([-128, 127, -128, 127], dtype=torch.int8)
    w_q[0, :4] = torch.tensor([-128, -128, 127, 127], dtype=torch.int8)
    x_s = torch.rand(m, 1, generator=g) * 0.01 + 1e-3
    w_s = torch.rand(n, generator=g) * 0.01 + 1e-3
    b = torch.randn(n, generator=g) if bias else None
    args = [t.to(DEVICE) if t is not None else None for t in (x_q, w_q, x_s, w_s, b)]
    y = I8.int8_gemm(*args, out_dtype=out_dtype)
    ref = R.w8a8_reference(*args, out_dtype=out_dtype)
    assert y.shape == (m, n) and y.dtype == out_dtype
    torch.testing.assert_close(y, ref, rtol=1e-5 if out_dtype == torch.float32 else 1e-3, atol=1e-4)


def test_int8_gemm_extremes_are_exact(kernels_active):
    """All -128 x -128 and 127 x -128 over K=192: the int32 sums must be exact."""
    m, k, n = 3, 192, 48
    x_q = torch.full((m, k), -128, dtype=torch.int8)
    x_q[1] = 127
    w_q = torch.full((n, k), -128, dtype=torch.int8)
    w_q[5] = 127
    ones_m, ones_n = torch.ones(m, 1), torch.ones(n)
    expected = torch.tensor([[-128.0], [127.0], [-128.0]]) @ torch.full((1, n), -128.0) * k
    expected[:, 5] = torch.tensor([-128.0, 127.0, -128.0]) * 127 * k
    ref = R.w8a8_reference(x_q, w_q, ones_m, ones_n, out_dtype=torch.float32)
    assert torch.equal(ref, expected)  # the reference itself, against arithmetic
    y = I8.int8_gemm(x_q.to(DEVICE), w_q.to(DEVICE), ones_m.to(DEVICE), ones_n.to(DEVICE),
                    out_dtype=torch.float32)
    assert torch.equal(y.cpu(), expected)


def test_w8a8_linear_end_to_end(kernels_active):
    x = torch.randn(2, 3, 128).to(DEVICE, torch.float16)
    w = torch.randn(48, 128)
    w_s = w.abs().amax(dim=1) / 127
    w_q = torch.round(w / w_s[:, None]).to(torch.int8)
    y = I8.w8a8_linear(x, w_q.to(DEVICE), w_s.to(DEVICE))
    assert y.shape == (2, 3, 48) and y.dtype == torch.float16
    x_q, x_s = R.quantize_per_token_int8(x)
    ref = R.w8a8_reference(x_q, w_q.to(DEVICE), x_s, w_s.to(DEVICE), out_dtype=torch.float16)
    torch.testing.assert_close(y.reshape(6, 48), ref, rtol=1e-3, atol=1e-3)
    # and the whole W8A8 chain stays close to the fp32 product
    assert _max_rel_err(y.reshape(6, 48).cpu(), x.float().reshape(6, 128).cpu() @ w.t()) < 0.05


def test_import_without_triton_falls_back(monkeypatch):
    """triton_available() reflects reality; functions work (via references) without triton."""
    assert TS.triton_available() == (DG.HAS_TRITON and (DG.INTERPRET or torch.cuda.is_available()))
    monkeypatch.setattr(TS, "HAS_TRITON", False)  # the one place every kernel module asks
    assert not TS.triton_available() and not TS.triton_installed()
    t = _make_gptq(64, 16, 4, 32, False, False, seed=5)
    x = torch.randn(2, 64)
    torch.testing.assert_close(
        DG.dequant_gemm(x, t["qweight"], t["scales"], t["qzeros"], None, 4, 32),
        R.w4a16_reference(x, t["qweight"], t["scales"], t["qzeros"], None, 4, 32),
    )
    q, s = I8.per_token_quant_int8(x)
    assert torch.equal(q, R.quantize_per_token_int8(x)[0])


# ----------------------------------------------------------------------------------------------
# GPU compile check without a GPU

_AOT_SCRIPT = r'''
import importlib, sys
sys.path.insert(0, sys.argv[1])  # the source tree first: it runs with or without an install
DG = importlib.import_module("quantkit.kernels.dequant_gemm")
I8 = importlib.import_module("quantkit.kernels.int8_gemm")
MG = importlib.import_module("quantkit.kernels.marlin_gemm")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

UNIT = {"stride_xk", "stride_qn", "stride_sn", "stride_zn", "stride_on", "stride_yn", "stride_ak",
        "stride_bk", "stride_xs", "stride_ws", "stride_cn"}

def compile_(fn, ptr_types, const, num_warps=4, num_stages=3):
    """Specialise like a real launch: unit strides constexpr, other ints / pointers 16-aligned."""
    sig, attrs, const = {}, {}, dict(const)
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in UNIT:
            sig[name], const[name] = "constexpr", 1
        else:
            sig[name] = ptr_types.get(name, "i32")
            if name not in ("M", "M_BUCKET", "K_TILES_PER_SPLIT"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=num_warps, num_stages=num_stages))

dq = lambda x, s, out: {"x_ptr": x, "qw_ptr": "*i32", "s_ptr": s, "qz_ptr": "*i32", "out_ptr": out, "y_ptr": out}
common = dict(BITS=4, GROUP_SIZE=128, HAS_ZEROS=True, DOT_PRECISION=None)
compile_(DG._dequant_splitk_kernel, dq("*fp16", "*fp16", "*fp32"),
         dict(common, BLOCK_M=1, BLOCK_N=128, BLOCK_K=128, SPLIT_K=4))
compile_(DG._dequant_splitk_kernel, dq("*bf16", "*bf16", "*fp32"),
         dict(common, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=8))
compile_(DG._dequant_tiled_kernel, dq("*fp16", "*fp16", "*fp16"),
         dict(common, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8), num_warps=8)
compile_(DG._dequant_tiled_kernel, dq("*fp32", "*fp16", "*fp32"),
         dict(BITS=8, GROUP_SIZE=32, HAS_ZEROS=False, DOT_PRECISION="ieee",
              BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=8))
fixed = dict(DG._GPU_TILED_CONFIG)  # QUANTKIT_TRITON_AUTOTUNE=0's config, at its largest (fp32, group 32)
compile_(DG._dequant_tiled_kernel, dq("*fp32", "*fp32", "*fp32"),
         dict(BITS=4, GROUP_SIZE=32, HAS_ZEROS=True, DOT_PRECISION="ieee",
              **{k: v for k, v in fixed.items() if k != "num_stages"}), num_stages=fixed["num_stages"])
compile_(I8._int8_gemm_kernel, {"a_ptr": "*i8", "b_ptr": "*i8", "xs_ptr": "*fp32", "ws_ptr": "*fp32",
                                "bias_ptr": "*fp16", "c_ptr": "*fp16"},
         dict(HAS_BIAS=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8))
compile_(I8._per_token_quant_kernel, {"x_ptr": "*fp16", "q_ptr": "*i8", "s_ptr": "*fp32"},
         dict(BLOCK=4096, ONE_PASS=False))
mg = {"x_ptr": "*fp16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*i32", "sidx_ptr": "*i32", "zidx_ptr": "*i32",
      "out_ptr": "*fp32"}  # the Marlin-layout split-K kernel (issue #49), GEMV and padded-dot forms
compile_(MG._marlin_splitk_kernel, mg, dict(GROUP_SIZE=128, HAS_ZEROS=True, KB=4, BLOCK_M=1, DOT_PRECISION=None))
compile_(MG._marlin_splitk_kernel, mg, dict(GROUP_SIZE=128, HAS_ZEROS=False, KB=4, BLOCK_M=16, DOT_PRECISION=None))
print("compiled")
'''


@pytest.mark.slow  # subprocesses that import triton and compile: ~6 CPU s
def test_autotune_switch_picks_the_fixed_gpu_configs():
    """QUANTKIT_TRITON_AUTOTUNE=0 (read at import) replaces autotuning by one fixed config per GEMM on
    a GPU; the interpreter always takes its own fixed configs. Fresh processes: the flag is read once."""
    import subprocess

    probe = ("import importlib; D = importlib.import_module('quantkit.kernels.dequant_gemm'); "
             "I = importlib.import_module('quantkit.kernels.int8_gemm'); "
             "print(D._FIXED_SPLITK_CONFIG == D._GPU_SPLITK_CONFIG, D._FIXED_TILED_CONFIG == D._GPU_TILED_CONFIG, "
             "D._FIXED_TILED_CONFIG == D._INTERP_TILED_CONFIG, I._FIXED_GEMM_CONFIG is None)")
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "QUANTKIT_TRITON_AUTOTUNE")}

    def run(**env):
        r = subprocess.run([sys.executable, "-c", probe], env={**base, **env}, cwd=str(ROOT), capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.split()

    if not DG.HAS_TRITON:
        pytest.skip("triton is not installed")
    assert run(QUANTKIT_TRITON_AUTOTUNE="0") == ["True", "True", "False", "False"]
    assert run() == ["False", "False", "False", "True"]  # autotuned: no fixed config
    assert run(TRITON_INTERPRET="1", QUANTKIT_TRITON_AUTOTUNE="1") == ["False", "False", "True", "False"]


@pytest.mark.skipif(DEVICE == "cuda" and not DG.INTERPRET,
                    reason="with a GPU the kernel tests compile and run for real")
@pytest.mark.slow  # subprocesses that import triton and compile: ~6 CPU s
def test_kernels_compile_for_sm90_without_gpu(tmp_path):
    """The interpreter skips GPU-only rules (tl.dot >= 16, layouts, dtypes): compile real sm_90
    binaries ahead of time with triton's bundled ptxas, in a fresh process without the interpreter."""
    import subprocess

    if not DG.HAS_TRITON:
        pytest.skip("triton is not installed")
    try:
        importlib.import_module("triton.backends.nvidia.compiler")
    except ImportError:
        pytest.skip("this triton build has no NVIDIA backend")
    script = tmp_path / "aot.py"
    script.write_text(_AOT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_DEFAULT_FP_FUSION="1")
    r = subprocess.run([sys.executable, str(script), str(ROOT)], env=env, cwd=str(ROOT),
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("triton's ptxas is not available here")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


def test_pinned_config_is_what_the_kernel_launches_with(kernels_active, monkeypatch):
    """dequant_gemm.pin_config (issue #49: configs chosen at load / warm-up, nothing tuned at call
    time): a call of the pinned shape launches the kernel with the pinned block sizes, others keep
    the fixed config; the result equals the reference either way."""
    launches = []

    class Recording:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, {k: kwargs[k] for k in ("BLOCK_N", "BLOCK_K", "SPLIT_K")}))
                return self.kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(DG, "_dequant_splitk_kernel", Recording(DG._dequant_splitk_kernel))
    monkeypatch.setattr(DG, "_PINNED", {})
    t = _make_gptq(128, 96, 4, 32, False, False, seed=11)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    qweight, scales, qzeros = t["qweight"].to(DEVICE), t["scales"].float().to(DEVICE), t["qzeros"].to(DEVICE)
    key = DG.config_key(1, 96, 128, 4, 32, True, torch.float32, torch.float32)
    assert key != DG.config_key(2, 96, 128, 4, 32, True, torch.float32, torch.float32)
    DG.pin_config(key, dict(BLOCK_N=64, BLOCK_K=32, SPLIT_K=1))
    assert DG.pinned_configs() == {key: dict(BLOCK_N=64, BLOCK_K=32, SPLIT_K=1)}
    want = R.w4a16_reference(x, qweight, scales, qzeros, None, 4, 32)
    torch.testing.assert_close(DG.dequant_gemm(x, qweight, scales, qzeros, None, 4, 32), want, atol=1e-4, rtol=1e-4)
    assert launches[-1] == ((2, 1), dict(BLOCK_N=64, BLOCK_K=32, SPLIT_K=1))  # cdiv(96, 64) x 1
    torch.testing.assert_close(DG.dequant_gemm(x.expand(2, 128).contiguous(), qweight, scales, qzeros, None, 4, 32),
                               want.expand(2, 96), atol=1e-4, rtol=1e-4)
    fixed = DG._FIXED_SPLITK_CONFIG
    assert launches[-1][1] == {k: fixed[k] for k in ("BLOCK_N", "BLOCK_K", "SPLIT_K")}  # M = 2: not pinned
    with pytest.raises(ValueError, match="SPLIT_K"):
        DG.pin_config(key, dict(BLOCK_N=64, BLOCK_K=32))
