"""quantkit.engine: block manager, scheduler, sampler, rotary, KV cache, the paged-decode kernel
(Triton interpreter vs PyTorch reference), and the engine end to end against transformers.

Fast tests use tiny random Llama-family models built here; the ``slow`` ones run the demo model
(SmolLM2-135M-Instruct) in fp32 on CPU, where greedy tokens must equal transformers' ``generate``.
Every engine test ends by checking that the KV pool is back to full (no leaked blocks).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import transformers

from quantkit.engine import LLMEngine, SamplingParams, engine_logits_fn
from quantkit.engine.block_manager import BlockManager
from quantkit.engine.kv_cache import KVCache, bytes_per_block, dequantize_kv, parse_bytes, quantize_kv
from quantkit.engine.rotary import RotaryEmbedding, rope_parameters
from quantkit.engine.sampler import Sampler, top_k_top_p_mask
from quantkit.engine.scheduler import Scheduler
from quantkit.engine.sequence import Sequence, SequenceStatus
from quantkit.errors import QuantkitError
from quantkit.kernels import paged_attention as pa
from quantkit.kernels import triton_support
from tiny_models import (ForcingSampler, assert_engine_logits, assert_pool_full, greedy, hf_greedy, tiny_model,
                         with_rtn_quantlinears)
from tiny_models import prompts as _prompts


pytestmark = pytest.mark.usefixtures("one_thread")


# ====================================================================== block manager
def _seq(tokens, bs=4, n=8):
    return Sequence(list(tokens), greedy(n), bs)


def test_block_manager_alloc_free_no_leak():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = _seq(range(10, 19)), _seq(range(50, 55))  # 9 tokens -> 3 blocks, 5 tokens -> 2 blocks
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert len(set(a.block_table) | set(b.block_table)) == 5
    assert bm.num_free_blocks == 3 and bm.peak_used == 5
    assert not bm.can_allocate(_seq(range(100, 116)))  # needs 4
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 8 and a.block_table == [] and a.num_cached_tokens == 0
    assert all(blk.ref_count == 0 for blk in bm.blocks)
    with pytest.raises(RuntimeError):
        bm._release(0)


def test_block_manager_prefix_sharing_and_refcounts():
    bm = BlockManager(num_blocks=10, block_size=4)
    prefix = list(range(20, 28))  # two full blocks
    a, b = _seq(prefix + [1, 2, 3]), _seq(prefix + [7, 8, 9, 10, 11])
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table[:2] == b.block_table[:2], "full prefix blocks are shared"
    assert a.block_table[2] != b.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 8 and b.prefill_start == 8
    assert (bm.prefix_hit_blocks, bm.prefix_queried_blocks) == (2, 2 + 3)  # b has 3 full blocks
    assert bm.num_used_blocks == 3 + 2
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.deallocate(b)
    assert bm.num_free_blocks == 10
    # the same first block after a different first block is a different prefix: no hit
    c = _seq([99, 98, 97, 96] + prefix[4:8] + [0])
    bm.allocate(c)
    assert c.num_cached_tokens == 0
    bm.deallocate(c)
    assert bm.num_free_blocks == 10


def test_block_manager_revive_evict_and_all_cached():
    bm = BlockManager(num_blocks=3, block_size=4)
    prompt = list(range(30, 38))  # exactly two full blocks
    a = _seq(prompt)
    bm.allocate(a)
    first = list(a.block_table)
    bm.deallocate(a)  # freed, but hashes and contents stay
    b = _seq(prompt)
    bm.allocate(b)
    assert b.block_table == first and b.num_cached_tokens == 8
    assert b.prefill_start == 7, "a fully cached prompt still recomputes its last token"
    bm.deallocate(b)
    # other content takes every free block: the cached prefix is evicted, and never falsely hit
    c = _seq(range(60, 72))
    bm.allocate(c)
    bm.deallocate(c)
    d = _seq(prompt)
    bm.allocate(d)
    assert d.num_cached_tokens == 0
    bm.deallocate(d)
    assert bm.num_free_blocks == 3


def test_block_manager_decode_append_registers_full_blocks():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = _seq([5, 6, 7])
    bm.allocate(a)
    assert len(a.block_table) == 1
    a.append_token(8)  # fills block 0 (its K/V is written by the next decode)
    assert bm.can_append(a)
    bm.may_append(a)
    assert len(a.block_table) == 1 and bm.blocks[a.block_table[0]].hash is not None
    a.append_token(9)  # needs a second block
    bm.may_append(a)
    assert len(a.block_table) == 2
    b = _seq([5, 6, 7, 8, 1])
    bm.allocate(b)
    assert b.block_table[0] == a.block_table[0] and b.num_cached_tokens == 4
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 6
    full = BlockManager(num_blocks=1, block_size=4)
    s = _seq([1, 2, 3, 4])
    full.allocate(s)
    s.append_token(5)
    assert not full.can_append(s)


def test_block_manager_lookahead_rollback_and_hashing_several_blocks():
    """Speculative steps reserve slots past the last token (may_append with a lookahead); after the
    step the blocks past the committed tokens go back to the front of the free list (rollback), and
    every block the accepted tokens filled is hashed, chained, so a later prompt hits them all."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq([1, 2, 3])
    bm.allocate(a)
    a.append_token(4)
    assert bm.can_append(a, 5) and not bm.can_append(a, 30)
    bm.may_append(a, 5)  # the last token + 5 draft tokens: 9 slots, 3 blocks
    assert len(a.block_table) == 3 and bm.blocks[a.block_table[0]].hash is not None
    for t in (5, 6, 7, 8, 9):  # 5 tokens accepted: 9 committed, blocks 0 and 1 full
        a.append_token(t)
    bm.rollback(a)
    assert len(a.block_table) == 3  # 9 tokens still need 3 blocks
    a.append_token(10)
    bm.may_append(a, 0)
    assert bm.blocks[a.block_table[1]].hash is not None  # filled by accepted tokens, hashed on the next step
    del a.token_ids[-2:]  # as if only 8 were committed: block 2 holds rejected tokens only
    bm.rollback(a)
    assert len(a.block_table) == 2 and next(iter(bm.free)) not in a.block_table  # front of the free list
    b = _seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table and b.num_cached_tokens == 8
    bm.deallocate(b)
    bm.deallocate(a)
    assert bm.num_free_blocks == 8
    c = _seq([1, 2, 3, 4, 5])  # its first block is cached: rolling back into a hashed block is a bug
    bm.allocate(c)
    del c.token_ids[:]
    with pytest.raises(RuntimeError, match="cached or shared"):
        bm.rollback(c)


# ====================================================================== scheduler (no model)
def _drive(sched: Scheduler, token=5, max_steps=10_000):
    """Run the scheduler with a fake model that always emits ``token``; returns (steps, max running)."""
    steps, peak = [], 0
    for _ in range(max_steps):
        if sched.is_finished():
            return steps, peak
        seqs, is_prefill = sched.schedule()
        assert seqs, "scheduler stalled"
        peak = max(peak, len(sched.running))
        steps.append((is_prefill, [s.seq_id for s in seqs]))
        sched.postprocess(seqs, [token] * len(seqs), now=0.0)
    raise AssertionError("did not finish")


def test_scheduler_continuous_batching_caps_and_preemption():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=64, eos_token_ids=frozenset({2}))
    seqs = [Sequence(list(range(10 + 7 * i, 15 + 7 * i)), greedy(n), 4) for i, n in enumerate([3, 12, 9, 4, 6])]
    for s in seqs:
        sched.add(s)
    steps, peak = _drive(sched)
    assert peak <= 3
    assert all(s.status == SequenceStatus.FINISHED and s.num_completion_tokens == s.sampling_params.max_tokens
               for s in seqs)
    assert sched.num_preemptions > 0, "6 blocks for 3 growing sequences must preempt"
    assert bm.num_free_blocks == bm.num_blocks
    # a request that joined later was prefilled while others were mid-decode
    first_decode = next(i for i, (p, _) in enumerate(steps) if not p)
    assert any(p for p, _ in steps[first_decode:])
    # eos stops a request unless ignore_eos
    bm2 = BlockManager(num_blocks=4, block_size=4)
    sched2 = Scheduler(bm2, eos_token_ids=frozenset({2}))
    a, b = Sequence([3, 4], greedy(5), 4), Sequence([3, 4], greedy(5, ignore_eos=True), 4)
    sched2.add(a)
    sched2.add(b)
    _drive(sched2, token=2)
    assert (a.num_completion_tokens, a.finish_reason) == (1, "stop")
    assert (b.num_completion_tokens, b.finish_reason) == (5, "length")
    assert bm2.num_free_blocks == 4


def test_scheduler_token_budget_and_oversized_request():
    bm = BlockManager(num_blocks=20, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    for i in range(3):
        sched.add(Sequence(list(range(40 + 10 * i, 46 + 10 * i)), greedy(1), 4))
    seqs, is_prefill = sched.schedule()
    assert is_prefill and len(seqs) == 1, "6 + 6 tokens exceed a budget of 10"
    _drive(sched)
    with pytest.raises(QuantkitError, match="KV blocks"):
        sched.add(Sequence(list(range(70)), greedy(20), 4))  # 90 tokens > 20 blocks x 4


# ====================================================================== sampler
def _mask_loop(logits, top_k, top_p):
    """Straightforward per-row top-k then top-p (on the renormalised top-k distribution)."""
    B, V = logits.shape
    drop = torch.ones(B, V, dtype=torch.bool)
    for b in range(B):
        order = sorted(range(V), key=lambda j: -logits[b, j].item())
        k = top_k[b] if top_k[b] > 0 else V
        kept = order[:k]
        probs = torch.softmax(logits[b, kept], dim=0).tolist()
        total, final = 0.0, []
        for j, p in zip(kept, probs):
            final.append(j)
            total += p
            if total >= top_p[b] - 1e-7:
                break
        drop[b, final] = False
    return drop


def test_sampler_top_k_top_p_masks_match_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g) * 3
    top_k = [0, 5, 1, 40, 3, 0]
    top_p = [0.9, 1.0, 0.5, 0.3, 0.99, 1.0]
    got = top_k_top_p_mask(logits, torch.tensor(top_k), torch.tensor(top_p))
    assert torch.equal(got, _mask_loop(logits, top_k, top_p))
    assert not got[5].any()


def test_sampler_greedy_and_seeded_determinism():
    torch.manual_seed(1)
    logits = torch.randn(3, 100)
    sampler = Sampler()

    def fresh(params):
        return [SimpleNamespace(sampling_params=p, generator=None) for p in params]

    g = sampler(logits, fresh([greedy(1), SamplingParams(top_k=1), greedy(1)]))
    assert g == logits.argmax(-1).tolist() and g[1] == logits[1].argmax().item()
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=7), SamplingParams(temperature=1.5, top_k=10, seed=8)]
    seqs1, seqs2 = fresh(params), fresh(params)
    draws1 = [sampler(logits[:2], seqs1) for _ in range(20)]
    draws2 = [sampler(logits[:2], seqs2) for _ in range(20)]
    assert draws1 == draws2, "same seeds, same draws"
    # a seeded request draws the same tokens whatever it is batched with
    solo = fresh(params[1:])
    assert [sampler(logits[1:2], solo)[0] for _ in range(20)] == [d[1] for d in draws1]
    top10 = set(logits[1].topk(10).indices.tolist())
    assert all(d[1] in top10 for d in draws1)
    assert len({d[0] for d in draws1}) > 1, "sampling at temperature 0.8 should not be constant"


def test_sampling_params_validation():
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0), dict(top_k=-2)):
        with pytest.raises(QuantkitError):
            SamplingParams(**bad)


# ====================================================================== rotary, KV cache dtypes
ROPES = [
    None,
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
]


@pytest.mark.parametrize("rope", ROPES, ids=["default", "linear", "llama3", "yarn"])
def test_rotary_matches_transformers(rope):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                                   **({"rope_parameters": rope} if rope else {}))
    pos = torch.arange(0, 300)
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, 300, 16), pos[None])
    c2, s2 = RotaryEmbedding.from_config(cfg).cos_sin(pos, torch.float32)
    assert torch.equal(cos[0], c2) and torch.equal(sin[0], s2)
    # the engine's four-op rotation (roll by D/2, half-negated sin) equals transformers' formula bit for bit
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    for dtype in (torch.float32, torch.bfloat16):
        q, k = torch.randn(2, 300, 4, 16).to(dtype).unbind(0)
        c, s = c2.to(dtype), s2.to(dtype)
        want_q, want_k = apply_rotary_pos_emb(q, k, c, s, unsqueeze_dim=1)  # q, k [N, heads, D]
        signed = RotaryEmbedding.signed_sin(s)[:, None, :]
        assert torch.equal(RotaryEmbedding.rotate(q, c[:, None, :], signed), want_q)
        assert torch.equal(RotaryEmbedding.rotate(k, c[:, None, :], signed), want_k)


def test_layer_plan_calls_plain_linears_directly_but_keeps_hooked_ones_whole(monkeypatch):
    """The runner calls an nn.Linear from its weight and bias, except when the module has hooks
    (accelerate's offload moves weights in a pre-forward hook): then the module itself. A few fp32
    rows may take kernels.cpu_gemv's fp32 kernel, whose summation order is its own: that is held to
    fp32's error bound for any order against the fp64 product, not to bit-equality with nn.Linear
    (which holds on some CPUs and not on others); without that kernel the call is F.linear's, bit-equal."""
    from torch import nn

    from quantkit.engine.decoder import matmul_fn
    from quantkit.runtime import backends

    lin = nn.Linear(8, 5)
    x = torch.randn(3, 8)
    direct = matmul_fn(lin, torch.float32)
    assert direct is not lin
    w, b = lin.weight.detach(), lin.bias.detach()
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    terms = 8 + 1  # products plus the bias: any summation order errs by at most ~n eps of the |terms| sum
    bound = (terms + 1) * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().t() + b.abs()).double()
    assert ((direct(x).double() - exact).abs() <= bound).all()
    monkeypatch.setattr(backends, "cpu_decode_kernel", lambda: None)  # QUANTKIT_CPU_DECODE_KERNEL=0
    assert torch.equal(matmul_fn(lin, torch.float32)(x), lin(x))
    lin.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    hooked = matmul_fn(lin, torch.float32)
    assert hooked is lin and torch.equal(hooked(x), lin(x))


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("out_features,in_features,bias", [(576, 576, False), (960, 576, True), (576, 1536, False),
                                                           (8192, 576, False)])
def test_sliced_linear_is_f_linear_bit_for_bit(out_features, in_features, bias, threads):
    """An fp32 linear of 1-4 rows as one bmm over slices of its output rows (each slice's
    matrix-vector product on its own thread) gives exactly F.linear's result, bias included;
    more rows, other dtypes and other layouts of the rows take F.linear itself."""
    from functools import partial

    from quantkit.engine.sliced_linear import MAX_ROWS, SlicedLinear, linear_fn, slicing_is_exact

    gen = torch.Generator().manual_seed(out_features + threads)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    fn = linear_fn(w, b, threads=threads)  # one slice per thread at these sizes, where the probe finds it exact
    # bit-equality of the slices is the BLAS's choice (1-4 rows are on the CPUs seen so far): the engine
    # probes it on the machine it runs on, and the result must be F.linear's either way
    assert isinstance(fn, SlicedLinear) == slicing_is_exact(SlicedLinear(w, b, threads))
    if isinstance(fn, SlicedLinear):
        assert fn.slices.shape == (threads, in_features, out_features // threads)
    for m in range(1, MAX_ROWS + 3):
        x = torch.randn(m, in_features, generator=gen)
        assert torch.equal(fn(x), torch.nn.functional.linear(x, w, b)), m
        xt = torch.randn(in_features, m, generator=gen).t()  # F.linear's rounding follows these strides
        assert torch.equal(fn(xt), torch.nn.functional.linear(xt, w, b)), m
    # plain F.linear where slicing cannot pay or apply
    assert isinstance(linear_fn(w.bfloat16(), None, threads=threads), partial)  # bf16 runs threaded already
    assert isinstance(linear_fn(w, b, threads=1), partial)
    assert isinstance(linear_fn(w[:64, :8].contiguous(), None, threads=threads), partial)  # too small to pay
    assert isinstance(linear_fn(w[:-1], None, threads=threads), partial)  # rows do not divide into slices


def test_rms_norm_is_transformers_bit_for_bit():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from quantkit.models.norms import rms_norm

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in ((1, 576), (7, 64), (3, 5, 96)):
            norm = LlamaRMSNorm(shape[-1], eps=1e-5)
            norm.weight.data = torch.randn(shape[-1]).to(dtype)
            x = (torch.randn(shape) * 4).to(dtype)
            with torch.no_grad():
                assert torch.equal(rms_norm(x, norm.weight, 1e-5), norm(x)), (dtype, shape)


def test_rope_parameters_legacy_config():
    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 4.0}, hidden_size=64,
                          num_attention_heads=4, head_dim=None)
    assert rope_parameters(old) == {"type": "linear", "factor": 4.0, "rope_theta": 5e5, "rope_type": "linear"}
    rot = RotaryEmbedding.from_config(old)
    base = 1.0 / (5e5 ** (torch.arange(0, 16, 2).float() / 16))
    assert torch.allclose(rot.inv_freq, base / 4.0)


def test_kv_quantization_and_bytes_per_block():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.rand(50, 3, 1) * 10
    q, s = quantize_kv(x, torch.int8)
    assert q.dtype == torch.int8 and s.shape == (50, 3)
    assert ((dequantize_kv(q, s, torch.float32) - x).abs() <= s[..., None] / 2 + 1e-6).all()
    q8, s8 = quantize_kv(x, torch.float8_e4m3fn)
    err = (dequantize_kv(q8, s8, torch.float32) - x).abs()
    assert (err <= x.abs() * 2 ** -4 + s8[..., None] * 2 ** -9).all()  # 3 mantissa bits, subnormals
    # the demo model: 30 layers, 3 KV heads of 64, 16-token blocks
    assert bytes_per_block(30, 16, 3, 64, torch.float32, False) == 737280
    assert bytes_per_block(30, 16, 3, 64, torch.bfloat16, False) == 368640
    assert bytes_per_block(30, 16, 3, 64, torch.int8, True) == 2 * 30 * 16 * 3 * (64 + 4)
    assert parse_bytes("1.5GiB") == 3 << 29 and parse_bytes("512MB") == 512 << 20 and parse_bytes(4096) == 4096
    cache = KVCache(2, 4, 4, 3, 8, torch.float32, "int8")
    k = torch.randn(3, 3, 8)
    cache.store(1, k, k * 2, torch.tensor([5, -1, 0]))
    assert cache.k[1].view(-1, 3, 8)[-1].abs().sum() == 0, "slot -1 is skipped, not the last slot"
    got_k, got_v = cache.gather(1, torch.tensor([1, 0]), 6, torch.float32)
    assert torch.allclose(got_k[1], k[0], atol=0.05) and torch.allclose(got_v[4], 2 * k[2], atol=0.1)
    with pytest.raises(QuantkitError):
        KVCache(1, 1, 4, 1, 8, torch.float32, "int4")


# ====================================================================== paged-decode kernel
def _paged_case(dtype, kv_heads=2, group=3, head_dim=16, block_size=4, lens=(7, 1, 12, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(math.ceil(n / block_size) for n in lens) + 3
    perm = torch.randperm(n_blocks, generator=g).tolist()  # scattered, non-contiguous blocks
    tables, width = [], max(math.ceil(n / block_size) for n in lens)
    for n in lens:
        nb = math.ceil(n / block_size)
        row, perm = perm[:nb], perm[nb:]
        tables.append(row + [-1] * (width - nb))
    k = torch.randn(n_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(n_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g).to(dtype)
    return q, k, v, torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def _loop_attention(q, k, v, tables, lens, scale, ks=None, vs=None):
    """Per-sequence, per-head softmax attention over gathered K/V: the reference's reference."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    group = q.shape[1] // k.shape[2]
    for b, n in enumerate(lens.tolist()):
        kk = pa.gather_kv(k, ks, tables[b].clamp_min(0), n, torch.float32)
        vv = pa.gather_kv(v, vs, tables[b].clamp_min(0), n, torch.float32)
        for h in range(q.shape[1]):
            p = torch.softmax(kk[:, h // group] @ q[b, h].float() * scale, dim=0)
            out[b, h] = p @ vv[:, h // group]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_decode_triton_vs_reference(dtype):
    if not pa.HAS_TRITON or not (triton_support.INTERPRET or torch.cuda.is_available()):
        pytest.skip("triton interpreter not active")
    dev = "cuda" if torch.cuda.is_available() and not triton_support.INTERPRET else "cpu"
    # head_dim 24 and 192 (DeepSeek's padded MLA heads) are not powers of two: the kernel masks BLOCK_D
    for group, head_dim, block_size, lens in [(3, 16, 4, (7, 1, 12, 4)), (1, 8, 8, (16, 9)), (4, 32, 2, (3, 5)),
                                              (2, 24, 4, (6, 3)), (1, 192, 4, (5, 9))]:
        q, k, v, tables, lens_t = _paged_case(dtype, group=group, head_dim=head_dim, block_size=block_size, lens=lens)
        scale = head_dim ** -0.5
        ref = pa.paged_attention_decode_reference(q, k, v, tables, lens_t, scale)
        tol = 2e-3 if dtype == torch.float16 else 1e-5
        assert torch.allclose(ref.float(), _loop_attention(q, k, v, tables, lens_t, scale), atol=tol)
        out = pa.paged_attention_decode(*(t.to(dev) for t in (q, k, v, tables, lens_t)), scale, use_triton=True)
        assert out.dtype == dtype
        torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kv", ["model", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_gathered_cpu_path_vs_loop(dtype, kv):
    """The engine's CPU decode attention (slots gathered once per step, fp32 softmax attention)
    against the per-head loop, for one sequence (its bmm branch) and a batch of unequal lengths
    (its masked branch), on scattered blocks, with model-dtype and quantized caches."""
    for group, head_dim, block_size, lens in [(3, 16, 4, (7, 1, 12, 4)), (3, 16, 4, (10,)), (1, 8, 8, (16, 9)),
                                              (4, 32, 2, (3, 5))]:
        q, k, v, tables, lens_t = _paged_case(dtype, group=group, head_dim=head_dim, block_size=block_size, lens=lens)
        ks = vs = None
        if kv != "model":
            kv_dtype = torch.int8 if kv == "int8" else torch.float8_e4m3fn
            (k, ks), (v, vs) = quantize_kv(k, kv_dtype), quantize_kv(v, kv_dtype)
        scale = head_dim ** -0.5
        slots, mask = pa.decode_slots([t[t >= 0].tolist() for t in tables], lens_t.tolist(), block_size, q.device)
        assert (mask is None) == (len(set(lens)) == 1)
        out = pa.paged_attention_decode_gathered(q, k, v, slots, mask, scale, ks, vs)
        want = _loop_attention(q, k, v, tables, lens_t, scale, ks, vs)
        assert out.dtype == dtype and out.shape == q.shape
        # computed in fp32 from the same bf16 inputs as the loop: only the output's rounding to bf16 differs
        tol = 1e-5 if dtype == torch.float32 else 2 ** -8
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("kv", ["model", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_gathered_reads_one_run_of_blocks_as_a_view(dtype, kv):
    """One sequence whose blocks follow each other (the usual batch-1 case) gets its slots as a
    slice (a view of the cache instead of two gathers per layer): same output as the gathered
    slots and as the per-head loop; scattered blocks or a batch still get a tensor."""
    q, k, v, _, _ = _paged_case(dtype, group=3, head_dim=16, block_size=4, lens=(10, 3, 3))
    ks = vs = None
    if kv != "model":
        kv_dtype = torch.int8 if kv == "int8" else torch.float8_e4m3fn
        (k, ks), (v, vs) = quantize_kv(k, kv_dtype), quantize_kv(v, kv_dtype)
    table, n = [2, 3, 4], 10  # slots 8..17
    run, mask = pa.decode_slots([table], [n], 4, q.device)
    assert run == slice(8, 18) and mask is None
    scale = 16 ** -0.5
    got = pa.paged_attention_decode_gathered(q[:1], k, v, run, None, scale, ks, vs)
    gathered = pa.paged_attention_decode_gathered(q[:1], k, v, torch.arange(8, 18), None, scale, ks, vs)
    assert torch.equal(got, gathered)
    want = _loop_attention(q[:1], k, v, torch.tensor([table]), torch.tensor([n]), scale, ks, vs)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert isinstance(pa.decode_slots([[2, 4, 3]], [10], 4, q.device)[0], torch.Tensor)
    assert isinstance(pa.decode_slots([[2, 3], [4]], [8, 3], 4, q.device)[0], torch.Tensor)


@pytest.mark.parametrize("kv", ["model", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_extend_gathered_vs_per_query_loop(dtype, kv):
    """Several new tokens per sequence over its cached prefix (speculative verification): each
    query attends causally (query j of a sequence whose T tokens end with Q new ones sees T - Q + j
    + 1 of them). Against the per-head loop run once per query with that length, for sequences of
    different query counts (padding rows), one sequence on a run of blocks (a slice), and GQA."""
    for group, lens, query_lens in [(3, (7, 12, 4), (3, 1, 4)), (3, (10,), (5,)), (1, (9, 6), (2, 2))]:
        q, k, v, tables, _ = _paged_case(dtype, group=group, head_dim=16, block_size=4, lens=lens)
        ks = vs = None
        if kv != "model":
            (k, ks), (v, vs) = quantize_kv(k, torch.int8), quantize_kv(v, torch.int8)
        Q, B, H = max(query_lens), len(lens), q.shape[1]
        qq = torch.randn(B, Q, H, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        rows = [t[t >= 0].tolist() for t in tables]
        if B == 1:
            rows = [list(range(3, 3 + len(rows[0])))]  # consecutive blocks: read as a view
        starts = [n - m for n, m in zip(lens, query_lens)]
        slots, mask = pa.extend_slots(rows, starts, list(query_lens), 4, group, q.device)
        assert isinstance(slots, slice) == (B == 1)
        out = pa.paged_attention_extend_gathered(qq, k, v, slots, mask, 16 ** -0.5, ks, vs)
        assert out.shape == qq.shape and out.dtype == dtype
        table_t = torch.tensor([r + [0] * (tables.shape[1] - len(r)) for r in rows], dtype=torch.int32)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -8
        for b in range(B):
            for j in range(query_lens[b]):
                want = _loop_attention(qq[b:b + 1, j], k, v, table_t[b:b + 1], torch.tensor([starts[b] + j + 1]),
                                       16 ** -0.5, ks, vs)
                torch.testing.assert_close(out[b, j].float(), want[0], atol=tol, rtol=tol)
            assert torch.isfinite(out[b]).all()  # padding rows too


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_paged_decode_triton_quantized_cache(kv_dtype):
    if not pa.HAS_TRITON or not (triton_support.INTERPRET or torch.cuda.is_available()):
        pytest.skip("triton interpreter not active")
    q, k, v, tables, lens = _paged_case(torch.float32, lens=(9, 2, 6))
    kq, ks = quantize_kv(k, kv_dtype)
    vq, vs = quantize_kv(v, kv_dtype)
    scale = 16 ** -0.5
    ref = pa.paged_attention_decode_reference(q, kq, vq, tables, lens, scale, ks, vs)
    torch.testing.assert_close(ref, _loop_attention(q, kq, vq, tables, lens, scale, ks, vs), atol=1e-5, rtol=1e-5)
    dev = "cuda" if torch.cuda.is_available() and not triton_support.INTERPRET else "cpu"  # real GPU tensors there
    on = [t.to(dev) for t in (q, kq, vq, tables, lens)]
    out = pa.paged_attention_decode(*on, scale, ks.to(dev), vs.to(dev), use_triton=True).cpu()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    exact = pa.paged_attention_decode_reference(q, k, v, tables, lens, scale)
    assert (out - exact).abs().max() < (0.05 if kv_dtype == torch.int8 else 0.2)


# ====================================================================== tiny models end to end
TINY = {
    "llama": {},
    "llama-llama3rope": {"rope_parameters": ROPES[2]},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "phi3": {},
    "phi3-partialrope": {"partial_rotary_factor": 0.5},
    "opt": {},
    "opt-postnorm-projected": {"do_layer_norm_before": False, "word_embed_proj_dim": 32},
}


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_models_greedy_match_transformers(name):
    kind = name.split("-")[0]
    model = tiny_model(kind, **TINY[name])
    prompts = _prompts(4, [5, 17, 2, 33], seed=1)
    max_new = [9, 4, 12, 7]
    want = [hf_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    eng = LLMEngine(model, block_size=4, num_kv_blocks=40, max_num_seqs=2)
    got = eng.generate(prompts, [greedy(n) for n in max_new])
    assert [g["token_ids"] for g in got] == want
    m = eng.get_metrics()
    assert m["requests"] == 4 and m["output_tokens"] == sum(max_new) and m["kv_blocks_used"] <= 40
    assert_pool_full(eng)


def test_tiny_triton_decode_backend_and_preemption():
    if not pa.HAS_TRITON or not triton_support.INTERPRET:
        pytest.skip("triton interpreter not active")
    model = tiny_model("llama", num_hidden_layers=1)
    prompts = _prompts(3, [6, 3, 9], seed=2)
    want = [hf_greedy(model, p, 6) for p in prompts]
    eng = LLMEngine(model, block_size=4, num_kv_blocks=4, max_num_seqs=3, attention_backend="triton")
    assert eng.runner.use_triton
    got = eng.generate(prompts, greedy(6))
    assert [g["token_ids"] for g in got] == want
    assert eng.get_metrics()["num_preemptions"] > 0
    assert_pool_full(eng)


def test_tiny_prefix_cache_same_batch_and_full_hit():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 256, (12,), generator=g).tolist()  # 3 blocks of 4
    p1, p2 = shared + [7, 8], shared + [9]
    want = [hf_greedy(model, p, 5) for p in (p1, p2, shared)]
    eng = LLMEngine(model, block_size=4, num_kv_blocks=30)
    got = eng.generate([p1, p2], greedy(5))  # submitted together: the prefix is prefilled once
    assert [o["token_ids"] for o in got] == want[:2]
    m = eng.get_metrics()
    assert m["computed_prompt_tokens"] == len(p1) + len(p2) - 12 and m["prefix_hit_blocks"] == 3
    eng.reset_metrics()
    got = eng.generate([shared], greedy(5))  # every block cached: only the last token is recomputed
    assert got[0]["token_ids"] == want[2]
    m = eng.get_metrics()
    assert m["computed_prompt_tokens"] == 1 and m["prefix_hit_rate"] == 1.0
    assert_pool_full(eng)


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_tiny_engine_logits_match_transformers(kv):
    model = tiny_model("qwen2")
    x = torch.randint(3, 256, (3, 21), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(x).logits
    fn = engine_logits_fn(model, block_size=8, kv_cache_dtype=kv)
    got = fn(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # prefill attends over fresh K/V
    assert_pool_full(fn.engine_state["engine"])


@pytest.mark.parametrize("name", list(TINY))
def test_every_family_prefill_and_decode_logits_match_transformers(name):
    """The engine builds each family's model from its adapter: prefill logits at every position and
    decode logits along a teacher-forced continuation (K/V read back from the paged cache) equal
    transformers' forward."""
    model = tiny_model(name.split("-")[0], **TINY[name])
    x = torch.randint(3, 256, (2, 19), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(x).logits
    assert_engine_logits(model, x, want)


def test_engine_rejects_bad_input():
    model = tiny_model("llama", num_hidden_layers=1)
    eng = LLMEngine(model, block_size=4, num_kv_blocks=3)
    with pytest.raises(QuantkitError, match="KV blocks"):
        eng.generate([[5] * 10], greedy(8))
    with pytest.raises(QuantkitError, match="tokenizer"):
        eng.generate(["text"], greedy(2))
    with pytest.raises(QuantkitError, match=r"\[0, 256\)"):
        eng.generate([[5, 300]], greedy(2))
    with pytest.raises(QuantkitError, match="holds no block"):
        LLMEngine(model, kv_cache_memory="1KB")
    assert_pool_full(eng)
    gpt2 = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(QuantkitError, match="unsupported architecture 'gpt2'"):
        LLMEngine(gpt2, num_kv_blocks=4)
    windowed = LLMEngine(tiny_model("mistral", num_hidden_layers=1, sliding_window=16), num_kv_blocks=16)
    with pytest.raises(QuantkitError, match="sliding-window"):
        windowed.generate([[5] * 10], greedy(10))
    assert len(windowed.generate([[5] * 10], greedy(6))[0]["token_ids"]) == 6


# ====================================================================== the demo model (slow)
DEMO_PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived",
                "def fibonacci(n):", "Water boils at"]
DEMO_MAX_NEW = [12, 16, 6, 10]


@pytest.fixture(scope="module")
def demo(demo_dir):
    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    return model, tok


@pytest.fixture(scope="module")
def demo_reference(demo):
    """transformers' greedy generate, one prompt at a time (no padding), eos as configured."""
    model, tok = demo
    out = []
    for p, n in zip(DEMO_PROMPTS, DEMO_MAX_NEW):
        ids = tok(p, return_tensors="pt").input_ids
        out.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  do_sample=False)[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.slow
def test_demo_continuous_batching_matches_transformers(demo, demo_reference):
    model, tok = demo
    eng = LLMEngine(model, tok, max_num_seqs=2)  # 4 prompts, 2 slots: later ones join as others finish
    streamed: dict[int, str] = {}
    got = eng.generate(DEMO_PROMPTS, [greedy(n) for n in DEMO_MAX_NEW],
                       stream_callback=lambda i, t, piece: streamed.__setitem__(i, streamed.get(i, "") + piece))
    assert [g["token_ids"] for g in got] == demo_reference
    assert [streamed.get(i, "") for i in range(4)] == [g["text"] for g in got]
    m = eng.get_metrics()
    assert m["prefill_steps"] >= 3 and m["requests"] == 4 and m["ttft_ms"] > 0 and m["decode_tokens_per_s"] > 0
    assert_pool_full(eng)


@pytest.mark.slow
def test_demo_on_two_threads_sliced_linears_keep_transformers_tokens(demo, monkeypatch, request):
    """With the CPU decode kernels off (``QUANTKIT_CPU_DECODE_KERNEL=0``: the engine's bit-exact
    mode) and two threads, the fp32 demo's projections and LM head run as sliced bmm's (the rest of
    this module runs on one thread, where they stay F.linear); greedy tokens must still equal
    transformers' generate on the same two threads, with decode steps of one and of two rows."""
    from quantkit.engine.sliced_linear import SlicedLinear, slice_count, slicing_is_exact
    from quantkit.runtime import backends

    monkeypatch.setenv(backends.ENV_DECODE_KERNEL, "0")
    backends.cpu_decode_kernel.cache_clear()
    request.addfinalizer(backends.cpu_decode_kernel.cache_clear)  # runs before monkeypatch restores the variable
    model, tok = demo
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = []
        for p, k in zip(DEMO_PROMPTS[:3], DEMO_MAX_NEW[:3]):
            ids = tok(p, return_tensors="pt").input_ids
            want.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k,
                                       do_sample=False)[0, ids.shape[1]:].tolist())
        eng = LLMEngine(model, tok, max_num_seqs=2)
        plan = eng.runner.plans[0]
        # Which shapes slice bit-exactly is the BLAS's choice on this CPU (on one Xeon the 576 x 576
        # projections do not, on another they do): each linear must be sliced exactly where the
        # probe finds slicing its shape bit-exact, and the LM head is sliced on every machine seen so
        # far, so the sliced path is exercised.
        named = {"head": (eng.runner.head, model.lm_head.weight),
                 "q": (plan.q, model.model.layers[0].self_attn.q_proj.weight),
                 "k": (plan.k, model.model.layers[0].self_attn.k_proj.weight),
                 "o": (plan.o, model.model.layers[0].self_attn.o_proj.weight),
                 "down": (plan.down, model.model.layers[0].mlp.down_proj.weight)}
        for name, (fn, weight) in named.items():
            parts = slice_count(*weight.shape, 2)
            exact = parts > 1 and slicing_is_exact(SlicedLinear(weight.detach(), None, parts))
            assert isinstance(fn, SlicedLinear) == exact, name
        assert isinstance(eng.runner.head, SlicedLinear)
        got = eng.generate(DEMO_PROMPTS[:3], [greedy(k) for k in DEMO_MAX_NEW[:3]])
    finally:
        torch.set_num_threads(n)
    assert [g["token_ids"] for g in got] == want
    assert_pool_full(eng)


@pytest.mark.slow
def test_demo_preemption_keeps_tokens(demo, demo_reference):
    model, tok = demo
    # 4-token blocks, and just enough for the longest request alone: sequences must be preempted
    need = max(math.ceil((len(tok(p).input_ids) + n) / 4) for p, n in zip(DEMO_PROMPTS, DEMO_MAX_NEW))
    eng = LLMEngine(model, tok, block_size=4, num_kv_blocks=need, max_num_seqs=4)
    got = eng.generate(DEMO_PROMPTS, [greedy(n) for n in DEMO_MAX_NEW])
    assert [g["token_ids"] for g in got] == demo_reference
    m = eng.get_metrics()
    assert m["num_preemptions"] > 0 and m["kv_utilization"] == 1.0
    assert_pool_full(eng)


@pytest.mark.slow
def test_demo_prefix_caching_skips_shared_blocks(demo):
    model, tok = demo
    system = tok("You are a helpful assistant. Answer every question truthfully, concisely and in plain "
                 "English. Never make things up; when unsure, say so and explain why.").input_ids
    shared = system[:32]  # two full 16-token blocks
    p1 = shared + tok(" Question: what is the capital of Italy? Answer:").input_ids
    p2 = shared + tok(" Question: name a primary colour. Answer:").input_ids
    alone = []
    for p in (p1, p2):
        e = LLMEngine(model, tok, enable_prefix_caching=False, num_kv_blocks=16)
        alone.append(e.generate([p], greedy(8))[0]["token_ids"])
        assert_pool_full(e)
    eng = LLMEngine(model, tok, num_kv_blocks=16)
    first = eng.generate([p1], greedy(8))[0]["token_ids"]
    eng.reset_metrics()
    second = eng.generate([p2], greedy(8))[0]["token_ids"]
    assert [first, second] == alone
    m = eng.get_metrics()
    assert m["prefix_hit_blocks"] == 2 and m["computed_prompt_tokens"] == len(p2) - 32
    assert m["prefix_hit_rate"] == 2 / (len(p2) // 16)
    assert_pool_full(eng)


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_demo_quantized_kv_cache(demo, demo_reference, kv):
    """int8 / fp8 KV: greedy tokens identical on most prompts; along the reference continuation every
    decode step's logits stay within LOGIT_TOL of the fp32 cache's, and the argmax agrees wherever the
    reference's top-2 margin exceeds 2 x LOGIT_TOL. (On "Water boils at" the fp32 top-2 margin at
    step 5 is tiny, so a quantized cache may pick the other token there.)"""
    LOGIT_TOL = 0.6 if kv == "int8" else 1.5  # measured max over the vocab: 0.45 / 1.08; logits' std is ~3
    model, tok = demo
    eng = LLMEngine(model, tok, kv_cache_dtype=kv, num_kv_blocks=16)
    assert eng.kv_cache.bytes_per_block == 2 * 30 * 16 * 3 * (64 + 4)
    got = eng.generate(DEMO_PROMPTS, [greedy(n) for n in DEMO_MAX_NEW])
    same = sum(g["token_ids"] == r for g, r in zip(got, demo_reference))
    assert same >= 3
    assert_pool_full(eng)
    prompt, ref = tok(DEMO_PROMPTS[3]).input_ids, demo_reference[3]
    logits = {}
    for name in ("auto", kv):
        e = LLMEngine(model, tok, kv_cache_dtype=name, num_kv_blocks=4)
        e.sampler = ForcingSampler(ref)
        e.generate([prompt], greedy(len(ref), ignore_eos=True))
        logits[name] = torch.stack(e.sampler.logits)
        assert_pool_full(e)
    base, quant = logits["auto"], logits[kv]
    assert (base.argmax(-1).tolist() == ref)
    diff = (base - quant).abs().amax(-1)
    assert diff.max() < LOGIT_TOL, diff
    top2 = base.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 2 * LOGIT_TOL
    assert torch.equal(quant.argmax(-1)[decisive], base.argmax(-1)[decisive])


@pytest.mark.slow
def test_demo_perplexity_through_engine_matches_transformers(demo):
    from quantkit.scoring import perplexity

    model, tok = demo
    try:
        from quantkit.data import eval_token_stream

        tokens = eval_token_stream("lee", tok, max_tokens=1100)
    except Exception:  # corpus not available offline: any text will do
        tokens = torch.tensor(tok(" ".join(DEMO_PROMPTS * 80)).input_ids)
    ref = perplexity(model, tokens, seq_len=256, max_windows=4, batch_size=2)
    eng = LLMEngine(model, tok, num_kv_blocks=40, enable_prefix_caching=False)
    got = perplexity(model, tokens, seq_len=256, max_windows=4, batch_size=2, logits_fn=engine_logits_fn(eng))
    assert got["tokens"] == ref["tokens"] == 4 * 255
    assert abs(got["perplexity"] / ref["perplexity"] - 1) < 1e-3, (got, ref)
    assert_pool_full(eng)


@pytest.mark.slow
def test_api_generate_text_and_run_bench(tiny_llama_dir):
    from quantkit.engine import generate_text, run_bench

    pieces: list[str] = []
    out = generate_text(str(tiny_llama_dir), "Hello there", max_new_tokens=6, stream=pieces.append, ignore_eos=True)
    assert len(out["token_ids"]) == 6 and "".join(pieces) == out["text"]
    again = generate_text(str(tiny_llama_dir), "Hello there", max_new_tokens=6, ignore_eos=True)
    assert again["token_ids"] == out["token_ids"]
    chat = generate_text(str(tiny_llama_dir), "Hi", max_new_tokens=3, chat=True, temperature=0.7, seed=1,
                         ignore_eos=True)
    assert len(chat["token_ids"]) == 3 and chat["num_prompt_tokens"] > 3
    res = run_bench(str(tiny_llama_dir), batch=3, input_len=20, output_len=5, kv_cache_dtype="int8", block_size=8)
    for key in ("ttft_ms", "tpot_ms", "tokens_per_s", "kv_blocks_used", "kv_blocks_total", "kv_utilization",
                "prefix_hit_rate", "kv_bytes_per_block", "decode_tokens_per_s"):
        assert res[key] is not None, key
    assert res["output_tokens"] == 15 and res["kv_cache_dtype"] == "int8"
    assert res["kv_blocks_used"] == 3 * math.ceil((20 + 5 - 1) / 8)  # the last token is never cached
    assert res["kv_bytes_per_block"] == 2 * 2 * 8 * 2 * (16 + 4)  # K+V, 2 layers, 8 tokens, 2 KV heads, 16 B + scale


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_quantized_projections_match_per_module_forward(kind):
    """q/k/v and gate/up of QuantLinear layers run as one stacked matmul each (engine.fused): the
    logits equal transformers' own forward through the separate quantized modules."""
    model = with_rtn_quantlinears(tiny_model(kind), group_size=16, sym=False, backend="reference")
    x = torch.randint(3, 256, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(x).logits
    fn = engine_logits_fn(model, block_size=4, fuse_projections=True)
    got = fn(x)
    runner = fn.engine_state["engine"].runner
    assert all(qkv is not None and gate_up is not None for qkv, gate_up in runner.fused)
    # what the fused projections replace is not resolved (a QuantLinear would pack its own copy)
    assert all(p.q is p.k is p.v is p.gate is p.up is None and p.down is not None for p in runner.plans)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert_pool_full(fn.engine_state["engine"])


def test_gpu_decode_benchmark_script_runs_its_steps_on_a_tiny_shape(tmp_path, monkeypatch):
    """scripts/bench_decode_8b.py is #7's GPU measurement; no GPU here, so its steps run on the
    tiny shape on CPU: every decoder projection is replaced by a QuantLinear whose forward equals
    F.linear with the RTN-dequantized weight, and the script writes all three rows."""
    import importlib.util
    import json
    from pathlib import Path

    import torch.nn.functional as F

    from quantkit.quantizers.grid import rtn_quantize
    from quantkit.runtime.quant_linear import QuantLinear

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    monkeypatch.syspath_prepend(str(scripts))
    spec = importlib.util.spec_from_file_location("bench_decode_8b", scripts / "bench_decode_8b.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    model = bench.build_model("tiny", 1, torch.device("cpu"), torch.float32)
    weights = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and name.startswith("model.layers.")}
    assert bench.quantize_in_place(model, 64, "reference") == 7 == len(weights)
    for name, w in weights.items():
        module = model.get_submodule(name)
        assert isinstance(module, QuantLinear)
        x = torch.randn(3, w.shape[1])
        assert torch.equal(module(x), F.linear(x, rtn_quantize(w, 4, 64, True).dequantize(torch.float32)))

    out = tmp_path / "bench.json"
    assert bench.main(["--shape", "tiny", "--device", "cpu", "--prompt-len", "8", "--new-tokens", "4",
                       "--cuda-graph", "both", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    static = " (static step, no graph on CPU)"
    assert list(rows) == ["transformers generate float32", "engine float32 (unquantized)",
                          "engine float32 (unquantized)" + static, "engine int4 rtn (backend cpu)",
                          "engine int4 rtn (backend cpu)" + static]
    assert all(r["decode_tokens_per_s"] > 0 for r in rows.values())
    assert [r["static_step"] for r in list(rows.values())[1:]] == [False, True, False, True]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_lm_head_quant_leaves_the_tied_embedding_and_equals_its_dequantized_head(mode):
    """lm_head_quant runs the head through an RTN copy (per-row int8, or int4 in groups of 64 inputs)
    and touches nothing else: with tied embeddings the embedding keeps its values, the decoder's
    hidden states are unchanged, and the logits equal plain PyTorch's F.linear of transformers'
    final hidden states with the RTN-dequantized head (within the kernels' bf16 rounding)."""
    import torch.nn.functional as F

    from quantkit.quantizers.grid import rtn_quantize

    model = tiny_model("llama", tie_word_embeddings=True, hidden_size=128, intermediate_size=256)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    before = model.model.embed_tokens.weight.detach().clone()
    x = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        hidden = model(x, output_hidden_states=True).hidden_states[-1]
    bits, group = (8, -1) if mode == "int8" else (4, 64)
    want = F.linear(hidden, rtn_quantize(before, bits, group, True).dequantize(torch.float32))
    got = engine_logits_fn(model, block_size=4, lm_head_quant=mode)(x)
    assert torch.equal(model.model.embed_tokens.weight, before)
    err = (got - want).abs().max() / want.abs().max()
    assert err < 2 ** -7, err  # bf16 activations in the packed kernels
    with pytest.raises(QuantkitError, match="lm_head_quant"):
        LLMEngine(model, num_kv_blocks=4, lm_head_quant="int2")


def test_shortlist_head_scores_the_int4_heads_candidates_exactly():
    """lm_head_quant="shortlist": per position, the 64 candidates are the int4 head's top 64 (RTN
    groups of 64, against plain PyTorch's dequantized product, within the kernel's bf16 rounding),
    their logits are the unquantized head's (F.linear of transformers' final hidden states, fp32
    rounding), every other logit is -inf, so the argmax is the unquantized head's."""
    import torch.nn.functional as F

    from quantkit.engine.quantized_head import SHORTLIST
    from quantkit.quantizers.grid import rtn_quantize

    model = tiny_model("llama", tie_word_embeddings=True, hidden_size=128, intermediate_size=256)
    x = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        hidden = model(x, output_hidden_states=True).hidden_states[-1]
    weight = model.lm_head.weight.detach()
    exact = F.linear(hidden, weight)
    rough = F.linear(hidden, rtn_quantize(weight, 4, 64, True).dequantize(torch.float32))
    got = engine_logits_fn(model, block_size=4, lm_head_quant="shortlist")(x)
    chosen = torch.isfinite(got)
    assert SHORTLIST < weight.shape[0] and bool((chosen.sum(-1) == SHORTLIST).all())
    scale = float(exact.abs().max())
    assert float((got[chosen] - exact[chosen]).abs().max()) <= 1e-5 * scale
    cutoff = rough.topk(SHORTLIST, dim=-1).values[..., -1:]  # the int4 head's 64th best per position
    assert bool((rough.masked_fill(~chosen, float("inf")) >= cutoff - 2 ** -6 * scale).all())
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
