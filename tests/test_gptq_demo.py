"""GPTQ on the real demo model: better than RTN, act-order no worse, 8-bit close to the original.

The demo weights are already on a 4-bit grid (GGUF Q4_1), so compare methods with each other
rather than quoting absolute losses. Models are fake-quantized in memory by the real driver (the
exact weights the packed checkpoint dequantizes to: see test_external_oracle) and scored on the
held-out 10 % of the Lee corpus (8 windows of 512 tokens).

Calibration size. The issue asks for 128 x 512 tokens; on CI's two cores that is about 15 minutes
per GPTQ run, so CI uses 64 windows of 128 tokens (8k tokens, 1/8 of it) for the 4-bit runs.
Fewer tokens are not enough: with 8 x 512 tokens GPTQ overfits (held-out 43.71 against RTN's
43.58, while on its own calibration windows it beats RTN 37.26 to 39.79), and 128 x 128 gives
38.94. `scripts/bench_quantize.py` runs the full-size comparison. 8-bit is insensitive to the
calibration size, so its run uses 8 x 128.
"""
import pytest

from quantkit.quantizers import get_quantizer

pytestmark = pytest.mark.slow
W4 = dict(bits=4, group_size=64, sym=True, samples=64, seq_len=128)


def test_gptq_beats_rtn_act_order_no_worse_and_8bit_close(demo_bench):
    original = demo_bench.original()
    rtn = demo_bench.rtn(4, 64, True)
    gptq = demo_bench.quantized(get_quantizer("gptq"), **W4)
    gptq_act = demo_bench.quantized(get_quantizer("gptq", desc_act=True), **W4)
    gptq8 = demo_bench.quantized(get_quantizer("gptq"), bits=8, group_size=64, sym=True, samples=8, seq_len=128)
    print(f"\nheld-out ppl: original {original:.4f} rtn-w4g64 {rtn:.4f} gptq-w4g64 {gptq:.4f} "
          f"gptq-w4g64-actorder {gptq_act:.4f} gptq-w8g64 {gptq8:.4f}")
    assert gptq < rtn * 0.97  # clearly better, not a tie
    assert gptq_act <= gptq * 1.005  # act-order does not make it worse (0.5% noise allowance)
    assert abs(gptq8 - original) / original < 0.01
