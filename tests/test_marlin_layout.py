"""kernels.marlin_layout: Marlin's pre-shuffled int4 layout (issue #49). Oracles: the PTX ISA's
fragment layout of ``mma.m16n8k16`` B operands (written out here, independently of the module's
permutation tables), and the plain dequantized matmul of the GPTQ-packed weight
(``reference.dequantize_gptq``)."""
from __future__ import annotations

import pytest
import torch

from quantkit.kernels.marlin_layout import (marlin_dequantize, marlin_gemm_reference, shuffle, shuffle_codes,
                                            unshuffle, unshuffle_codes)
from quantkit.kernels.reference import dequantize_gptq, pack_gptq_qweight, pack_gptq_qzeros


def _gptq(k, n, group_size, sym, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = k // group_size if group_size > 0 else 1
    codes = torch.randint(0, 16, (k, n), generator=g)
    scales = torch.rand(groups, n, generator=g) * 0.1 + 0.01
    qzeros = None if sym else pack_gptq_qzeros(torch.randint(0, 16, (groups, n), generator=g), 4)
    return pack_gptq_qweight(codes, 4), scales, qzeros


def test_each_thread_word_holds_its_mma_b_fragments():
    """For a 32 x 128 weight (2 x 2 warp tiles of 16 x 64): word w of packed row kt belongs to warp
    tile w // 128, thread t = (w % 128) // 4 and 16 x 16 tile j = w % 4 (so a thread's four words are
    one 128-bit load, a warp's 32 loads contiguous), and holds exactly t's B fragments of
    mma.m16n8k16 (PTX ISA: rows 2 (t % 4) + {0, 1} and + 8, column t // 4 of each n8 half) with
    nibbles i and i + 4 rows k and k + 1 of one column (Marlin's dequantization pairs them)."""
    K, N = 32, 128
    k_idx = torch.arange(K)[:, None].expand(K, N)
    n_idx = torch.arange(N)[None, :].expand(K, N)
    # codes are 4 bits: shuffle k % 16, n % 16 and n // 16 separately and read (k, n) back per nibble
    layers = [shuffle_codes(c.contiguous()) for c in (k_idx % 16, n_idx % 16, n_idx // 16)]
    assert layers[0].shape == (K // 16, 2 * N) and layers[0].dtype == torch.int32
    nib = [((w[:, :, None] >> torch.arange(0, 32, 4)) & 0xF) for w in layers]  # [K/16, 2N, 8]
    for kt in range(K // 16):
        for w in range(2 * N):
            tile, t, j = w // 128, (w % 128) // 4, w % 4
            ks = [16 * kt + int(nib[0][kt, w, i]) for i in range(8)]
            ns = [int(nib[1][kt, w, i]) + 16 * int(nib[2][kt, w, i]) for i in range(8)]
            r0, c0 = 2 * (t % 4), 64 * tile + 16 * j + t // 4
            want = {(16 * kt + r, c) for r in (r0, r0 + 1, r0 + 8, r0 + 9) for c in (c0, c0 + 8)}
            assert set(zip(ks, ns)) == want, (kt, w)
            for i in range(4):
                assert ns[i] == ns[i + 4] and ks[i + 4] == ks[i] + 1, (kt, w, i)


@pytest.mark.parametrize("k,n,group_size,sym", [(128, 64, 32, True), (256, 128, 128, False), (64, 192, -1, False),
                                                (128, 256, 64, True), (512, 64, 128, False)])
def test_shuffle_round_trips_and_reference_equals_the_plain_dequantized_matmul(k, n, group_size, sym):
    """Unshuffle gives back the GPTQ tensors bit for bit; the shuffled layout dequantizes to the same
    fp32 weight as the GPTQ one, bit for bit; the reference GEMM on it equals x @ W in fp32 within
    fp32 rounding (atol 1e-5, rtol 1e-5; identical ops, so in practice exact) and the rounding of the
    output dtype for half activations."""
    qweight, scales, qzeros = _gptq(k, n, group_size, sym, seed=k + n)
    w = shuffle(qweight, scales, qzeros, group_size)
    assert w.qweight.shape == (k // 16, 2 * n) and (w.qzeros is None) == sym
    back = unshuffle(w)
    assert torch.equal(back[0], qweight) and torch.equal(back[1], scales)
    assert (back[2] is None) if sym else torch.equal(back[2], qzeros)
    if group_size > 0 and k // group_size > 1:  # the layout really moves things
        assert not torch.equal(w.scales, scales)
    dense = dequantize_gptq(qweight, scales, qzeros, None, 4, group_size)
    assert torch.equal(marlin_dequantize(w), dense)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(marlin_gemm_reference(x, w), x @ dense, atol=1e-5, rtol=1e-5)
    xh = x.to(torch.float16)
    torch.testing.assert_close(marlin_gemm_reference(xh, w), (xh.float() @ dense).half(), atol=0, rtol=0)


def test_codes_round_trip_and_bad_shapes():
    codes = torch.randint(0, 16, (48, 128), generator=torch.Generator().manual_seed(3))
    assert torch.equal(unshuffle_codes(shuffle_codes(codes), 48, 128), codes.to(torch.int32))
    qweight, scales, _ = _gptq(64, 96, 32, True)
    with pytest.raises(ValueError, match="N % 64"):
        shuffle(qweight, scales, None, 32)
    qweight, scales, _ = _gptq(64, 64, 32, True)
    with pytest.raises(ValueError, match="scales must be"):
        shuffle(qweight, scales[:1], None, 32)


@pytest.mark.parametrize("k,n,group_size,sym,rows", [(128, 64, 32, False, 1), (256, 128, 128, True, 5),
                                                     (192, 64, -1, False, 16), (512, 128, 64, False, 3)])
def test_triton_kernel_on_the_shuffled_layout_equals_the_reference(k, n, group_size, sym, rows):
    """kernels.marlin_gemm under the Triton interpreter (the kernel's arithmetic, not its speed: it
    has not run on a GPU) against marlin_gemm_reference, fp32 activations: within 1e-4 (split-K sums
    in another order). K not a multiple of the split: 192 = 12 k-tiles over 4 splits of 4."""
    from quantkit.kernels import marlin_gemm, triton_support

    if not triton_support.HAS_TRITON or not triton_support.INTERPRET:
        pytest.skip("triton interpreter not active")
    w = shuffle(*_gptq(k, n, group_size, sym, seed=k + rows), group_size)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = marlin_gemm_reference(x, w)
    torch.testing.assert_close(marlin_gemm.marlin_gemm(x, w, split_k=4, kb=2), want, atol=1e-4, rtol=1e-4)
