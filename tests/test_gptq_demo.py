"""GPTQ on the real demo model: better than RTN, act-order no worse, 8-bit close to the original.

The demo weights are already on a 4-bit grid (GGUF Q4_1), so compare methods with each other
rather than quoting absolute losses. Models are fake-quantized in memory by the real driver (the
exact weights the packed checkpoint dequantizes to: see test_external_oracle) and scored on the
held-out 10 % of the Lee corpus.
"""
import copy

import pytest
import torch

from quantkit import data
from quantkit.api import linear_shapes
from quantkit.calibrate import quantize_model
from quantkit.evaluate import perplexity
from quantkit.models import get_adapter
from quantkit.quantizers import get_quantizer
from quantkit.scheme import QuantScheme
from quantkit.sources import load_source_model

pytestmark = pytest.mark.slow
# The issue asks for 128 x 512 calibration tokens; on CI's 2 CPU cores three GPTQ runs at that size take
# most of an hour, so CI calibrates on 16 x 512 (the same code path; scripts/bench_quantize.py runs
# the full budget) and scores 8 held-out windows of 512 tokens.
NUM_SAMPLES, SEQ_LEN, WINDOWS = 16, 512, 8


@pytest.fixture(scope="module")
def demo():
    model, tok, _, _ = load_source_model("demo", dtype=torch.float32)
    calib = data.calibration_batches("lee", tok, num_samples=NUM_SAMPLES, seq_len=SEQ_LEN, seed=0)
    held_out = data.eval_token_stream("lee", tok)
    return model, calib, held_out


def run(demo, method, bits, group, **options):
    model, calib, held_out = demo
    m = copy.deepcopy(model)
    schemes = QuantScheme(bits=bits, group_size=group, sym=True).resolve(linear_shapes(m))
    quantize_model(m, get_adapter(m), get_quantizer(method, **options), schemes, calib, progress=False)
    return perplexity(m, held_out, seq_len=512, max_windows=WINDOWS)["perplexity"]


def test_gptq_beats_rtn_act_order_no_worse_and_8bit_close(demo):
    model, _, held_out = demo
    original = perplexity(model, held_out, seq_len=512, max_windows=WINDOWS)["perplexity"]
    rtn = run(demo, "rtn", 4, 64)
    gptq = run(demo, "gptq", 4, 64)
    gptq_act = run(demo, "gptq", 4, 64, desc_act=True)
    gptq8 = run(demo, "gptq", 8, 64)
    print(f"\nheld-out ppl: original {original:.4f} rtn-w4g64 {rtn:.4f} gptq-w4g64 {gptq:.4f} "
          f"gptq-w4g64-actorder {gptq_act:.4f} gptq-w8g64 {gptq8:.4f}")
    assert gptq < rtn
    assert gptq_act <= gptq * 1.005  # act-order does not make it worse (0.5% noise allowance)
    assert abs(gptq8 - original) / original < 0.01
