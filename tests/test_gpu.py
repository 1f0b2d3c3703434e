"""CUDA-only checks: the Triton kernels on real GPU tensors, in the dtypes a GPU serves (fp16, bf16),
and the paged-KV engine on CUDA against transformers' forward on the same GPU. Skipped without a
GPU (CI has none; the interpreter runs the same kernels on CPU tensors in the other test files);
``scripts/gpu_check.sh`` runs them on a lent GPU. Oracles are plain PyTorch: the fp32 dequantized
weight through ``F.linear``, and transformers' own forward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantkit.engine import LLMEngine, engine_logits_fn
from quantkit.kernels import triton_support
from quantkit.quantizers.grid import rtn_quantize
from quantkit.runtime import QuantLinear
from test_engine import TINY
from test_quant_linear import build, make_qw, rel_err
from tiny_models import assert_engine_logits, assert_pool_full, greedy, prompts, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or triton_support.INTERPRET,
                                reason="needs a CUDA GPU (Triton compiled for it, not the interpreter)")

CUDA = "cuda"
# fp32 runs ieee dots; fp16/bf16 accumulate in fp32 and round the output once, so the error to the
# fp32 oracle is the output's own rounding (fp16 ~5e-4, bf16 ~4e-3 relative) plus the activations'.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("fmt,bits,gs,sym,dynamic", [
    ("gptq", 4, 128, True, False),
    ("gptq", 4, 64, False, False),
    ("awq", 4, 64, False, False),  # the AWQ layout runs through the one-time repack to gptq
    ("gptq", 4, 32, False, True),  # act-order: rows sorted once, activation columns permuted per call
    ("compressed-tensors", 8, -1, True, False),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quant_linear_triton_on_cuda(fmt, bits, gs, sym, dynamic, dtype):
    """Every M regime of the dequant GEMM (GEMV at 1, padded dot at 2-16, tiled GEMM above)."""
    qw = make_qw(384, 512, bits, gs, sym, seed=5, dynamic=dynamic)
    m = build(qw, fmt, "triton", dtype=dtype).to(CUDA)
    w = qw.dequantize(torch.float32).to(CUDA)
    for rows in (1, 7, 16, 33, 300):
        x = torch.randn(rows, 512, device=CUDA).to(dtype)
        y = m(x)
        assert m._impl.name == "triton" and m._impl.fallback is None
        assert y.dtype == dtype and y.device.type == CUDA
        want = F.linear(x.float(), w) + qw.bias.to(CUDA)
        assert rel_err(y, want) < REL_TOL[dtype], (rows, rel_err(y, want))


def _dequantized_copy(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(int4 model with QuantLinear on the triton backend, the same model with the dequantized fp32
    weights in plain nn.Linear): the second is the oracle for the first."""
    import copy

    quant, plain = copy.deepcopy(model), copy.deepcopy(model)
    for layer_q, layer_p in zip(quant.model.layers, plain.model.layers):
        for parent_name in ("self_attn", "mlp"):
            pq, pp = getattr(layer_q, parent_name), getattr(layer_p, parent_name)
            for name, lin in list(pq.named_children()):
                if not isinstance(lin, nn.Linear):
                    continue
                qw = rtn_quantize(lin.weight.data.float().cpu(), 4, 32, False,
                                  None if lin.bias is None else lin.bias.data.float().cpu())
                setattr(pq, name, QuantLinear.from_quantized(qw, "gptq", dtype=torch.float32,
                                                             backend="triton").to(CUDA))
                getattr(pp, name).weight.data.copy_(qw.dequantize(torch.float32))
    return quant, plain


@pytest.mark.parametrize("name", list(TINY))
def test_every_family_logits_on_cuda(name):
    """Prefill logits at every position and teacher-forced decode logits (the Triton paged decode
    kernel reading K/V back from the cache) against transformers' forward on the same GPU, fp32.
    cuBLAS and SDPA reduce in other orders than the engine's kernels: 1e-4 as on CPU."""
    model = tiny_model(name.split("-")[0], **TINY[name]).to(CUDA)
    x = torch.randint(3, 256, (2, 19), generator=torch.Generator().manual_seed(4)).to(CUDA)
    with torch.no_grad():
        want = model(x).logits
    assert assert_engine_logits(model, x, want).runner.use_triton


def test_greedy_on_cuda_with_preemption_matches_transformers():
    """Continuous batching on a pool too small for all three sequences (preemption and recompute)."""
    model = tiny_model("llama", num_hidden_layers=1).to(CUDA)
    ps = prompts(3, [6, 3, 9], seed=2)
    want = []
    for p in ps:
        x = torch.tensor([p], device=CUDA)
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    eng = LLMEngine(model, block_size=4, num_kv_blocks=4, max_num_seqs=3)
    assert eng.runner.use_triton
    got = eng.generate(ps, greedy(6))
    assert [g["token_ids"] for g in got] == want
    assert eng.get_metrics()["num_preemptions"] > 0
    assert_pool_full(eng)


def test_int4_engine_on_cuda_matches_dequantized_oracle():
    """The engine with int4 Triton linears on CUDA: its prefill and decode logits equal a plain
    transformers forward whose nn.Linear weights are the dequantized fp32 weights."""
    quant, plain = _dequantized_copy(tiny_model("llama").to(CUDA))
    x = torch.randint(3, 256, (2, 21), generator=torch.Generator().manual_seed(6)).to(CUDA)
    with torch.no_grad():
        want = plain(x).logits
    assert_engine_logits(quant, x, want, prefill_block_size=8, row=1, prefix=10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_engine_on_cuda_tracks_transformers(dtype):
    """fp16/bf16 on CUDA, the dtypes users serve in: the engine's logits against transformers' in
    the same dtype, both compared with the fp32 forward: the engine may not be worse than transformers
    by more than half again (a wrong cast or an fp16 overflow would be orders of magnitude worse)."""
    model32 = tiny_model("llama").to(CUDA)
    x = torch.randint(3, 256, (4, 33), generator=torch.Generator().manual_seed(7)).to(CUDA)
    with torch.no_grad():
        ref = model32(x).logits
        model = model32.to(dtype)
        hf = model(x).logits.float()
    got = engine_logits_fn(model, block_size=8)(x).float()
    err_hf, err_engine = rel_err(hf, ref), rel_err(got, ref)
    assert err_engine <= 1.5 * err_hf + 1e-4, (err_engine, err_hf)


@pytest.mark.parametrize("weights", ["fp16", "int4"])
def test_static_step_cuda_graphs_give_the_eager_engines_tokens(weights):
    """engine.static_step on CUDA (issue #49): decode steps replayed from one CUDA graph per bucket
    (1, 2, 4; batches of 3 padded to 4, of 6 and 5 eager) give the eager engine's greedy tokens; a
    graph was captured for each bucket used. int4: Triton linears with fp32 activations."""
    model = tiny_model("llama").to(CUDA)
    model = _dequantized_copy(model)[0] if weights == "int4" else model.to(torch.float16)
    ps = prompts(6, [5, 9, 3, 12, 7, 4], seed=3)
    params = [greedy(n, ignore_eos=True) for n in (3, 5, 7, 9, 11, 14)]
    runs = {}
    for graphed in (False, True):
        eng = LLMEngine(model, block_size=8, num_kv_blocks=64, max_num_seqs=8, cuda_graph=graphed,
                        graph_buckets=(1, 2, 4))
        runs[graphed] = (eng, [o["token_ids"] for o in eng.generate(ps, params)])
        assert_pool_full(eng)
    (eager, want), (static, got) = runs[False], runs[True]
    assert eager.runner.static_step is None and static.runner.static_step is not None, static.runner.static_step_problem
    assert got == want
    step = static.runner.static_step
    assert sorted(step.graphs) == [1, 2, 4] and step.steps_by_bucket == {1: 3, 2: 2, 4: 4}
    assert step.eager_fallbacks == 4


@pytest.mark.parametrize("sym,group_size", [(True, 128), (False, 32), (False, -1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_marlin_layout_kernel_on_cuda(sym, group_size, dtype):
    """kernels.marlin_gemm (issue #49's split-K kernel on Marlin's pre-shuffled layout; checked on
    CPU only under the interpreter) on CUDA at 1, 7 and 16 rows against the fp32 dequantized matmul."""
    from quantkit.kernels.marlin_gemm import marlin_gemm
    from quantkit.kernels.marlin_layout import marlin_dequantize, shuffle
    from quantkit.kernels.reference import pack_gptq_qweight, pack_gptq_qzeros

    g = torch.Generator().manual_seed(9)
    k, n = 512, 384
    groups = 1 if group_size == -1 else k // group_size
    qweight = pack_gptq_qweight(torch.randint(0, 16, (k, n), generator=g), 4)
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.002).to(dtype)
    qzeros = None if sym else pack_gptq_qzeros(torch.randint(0, 16, (groups, n), generator=g), 4)
    w = shuffle(qweight.to(CUDA), scales.to(CUDA), None if sym else qzeros.to(CUDA), group_size)
    dense = marlin_dequantize(w)
    for rows in (1, 7, 16):
        x = torch.randn(rows, k, device=CUDA).to(dtype)
        y = marlin_gemm(x, w)
        assert y.dtype == dtype and y.device.type == CUDA
        assert rel_err(y, x.float() @ dense) < REL_TOL[dtype], rows


@pytest.mark.parametrize("scheme,method", [("NVFP4A16", "gptq"), ("FP8", "gptq"), ("NVFP4", "smoothquant+gptq")])
def test_float_presets_calibrate_on_cuda_as_on_the_cpu(tmp_path, scheme, method):
    """`quantize --scheme ... --device cuda` runs the float presets' calibration passes (GPTQ on the float grid,
    SmoothQuant's pass) on the GPU: the written weights agree with the CPU run's almost everywhere (the solves
    differ only in summation order, so few codes flip; a device bug would scramble them) and the checkpoint
    reads back through the float reader."""
    from quantkit.float_checkpoint import read_dequantized, write
    from quantkit.scheme_presets import preset

    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    written = {}
    for device in ("cpu", CUDA):
        model = tiny_model("llama")
        shapes = write(model, preset(scheme), tmp_path / device, method=method, calibration=ids, batch_size=4,
                       device=device)
        written[device] = read_dequantized(tmp_path / device)
        assert {n: tuple(w.shape) for n, w in written[device].items()} == shapes
    assert written["cpu"].keys() == written[CUDA].keys()
    for name, w in written["cpu"].items():
        same = (w == written[CUDA][name]).float().mean().item()
        assert same > 0.9, (name, same)
