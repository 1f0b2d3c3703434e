"""On-disk layouts: pack/unpack against independent plain-Python packers written here from the layout
descriptions, against compressed-tensors' own functions, across formats, and hostile inputs."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.formats import LinearSpec, format_for_quant_method, get_format
from quantkit.qtensor import QuantizedWeight
from quantkit.quantizers.grid import rtn_quantize

gptq = get_format("gptq")
ct = get_format("compressed-tensors")
awq = get_format("awq")


# ------------------------------------------------------------ independent reference packers

def to_i32(word: int) -> int:
    return word - (1 << 32) if word >= (1 << 31) else word


def ref_pack_line(values: list[int], bits: int) -> list[int]:
    """A line as one big little-endian integer: value i at bit i*bits, cut into 32-bit words."""
    acc = 0
    for i, v in enumerate(values):
        assert 0 <= v < (1 << bits)
        acc |= v << (i * bits)
    return [to_i32((acc >> (32 * w)) & 0xFFFFFFFF) for w in range(math.ceil(len(values) * bits / 32))]


def ref_pack_rows(m: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack each row of a 2-D integer tensor along its last dim."""
    return torch.tensor([ref_pack_line(row, bits) for row in m.tolist()], dtype=torch.int32)


def autogptq_pack_3bit(intweight: list[list[int]]) -> list[list[int]]:
    """Transcription of AutoGPTQ's unrolled 3-bit pack (rows = input dim, 32 rows -> 3 words)."""
    rows, cols = len(intweight), len(intweight[0])
    out = [[0] * cols for _ in range(rows // 32 * 3)]
    for c in range(cols):
        i = row = 0
        while row < len(out):
            w = 0
            for j in range(i, i + 10):
                w |= intweight[j][c] << (3 * (j - i))
            i += 10
            w |= (intweight[i][c] << 30) & 0xFFFFFFFF
            out[row][c] = w
            row += 1
            w = (intweight[i][c] >> 2) & 1
            i += 1
            for j in range(i, i + 10):
                w |= intweight[j][c] << (3 * (j - i) + 1)
            i += 10
            w |= (intweight[i][c] << 31) & 0xFFFFFFFF
            out[row][c] = w
            row += 1
            w = (intweight[i][c] >> 1) & 0x3
            i += 1
            for j in range(i, i + 10):
                w |= intweight[j][c] << (3 * (j - i) + 2)
            i += 10
            out[row][c] = w
            row += 1
    return [[to_i32(v) for v in r] for r in out]


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def ref_awq_pack(m_kn: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's loop: word col of row k holds column col*8 + order[i] in slot i."""
    k, n = m_kn.shape
    rows = m_kn.tolist()
    out = [[0] * (n // 8) for _ in range(k)]
    for r in range(k):
        for col in range(n // 8):
            w = 0
            for i in range(8):
                w |= rows[r][col * 8 + AWQ_ORDER[i]] << (4 * i)
            out[r][col] = to_i32(w)
    return torch.tensor(out, dtype=torch.int32)


# ------------------------------------------------------------ helpers

def make_qw(n, k, bits, gs, sym, seed=0, act_order="none", with_zero0=False) -> QuantizedWeight:
    torch.manual_seed(seed)
    w = torch.randn(n, k) * 0.05
    qw = rtn_quantize(w, bits, gs, sym, bias=torch.randn(n))
    if with_zero0:
        qw.zeros[::3, 0] = 0
    if act_order == "dynamic":
        g = k if gs == -1 else gs
        perm = torch.randperm(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
        qw.g_idx = g_idx
    qw.act_order = act_order
    return qw


def spec_of(qw):
    return LinearSpec.of(qw)


CASES = [  # (n, k, bits, group_size)
    (96, 256, 4, 32), (128, 128, 4, 128), (96, 576, 4, 64), (160, 192, 4, -1),
    (96, 256, 2, 64), (128, 256, 2, -1),
    (96, 256, 3, 32), (128, 384, 3, 128), (96, 256, 3, -1),
    (96, 256, 8, 64), (128, 192, 8, -1),
]


# ------------------------------------------------------------ gptq

@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("n,k,bits,gs", CASES)
def test_gptq_matches_reference_layout_and_round_trips(n, k, bits, gs, sym):
    qw = make_qw(n, k, bits, gs, sym, seed=n + k + bits)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = gptq.pack(qw)
    assert set(t) == {"qweight", "qzeros", "scales", "g_idx"}
    # qweight: column n of [K, N] is a line packed along K
    assert torch.equal(t["qweight"], ref_pack_rows(qw.qweight, bits).t())
    # qzeros: row g of [G, N] packed along N, storing (zero - 1) & mask
    stored = (qw.zeros.t().long() - 1) & ((1 << bits) - 1)
    assert torch.equal(t["qzeros"], ref_pack_rows(stored, bits))
    assert t["scales"].dtype == torch.float16 and torch.equal(t["scales"].float(), qw.scales.t())
    assert t["g_idx"].dtype == torch.int32 and torch.equal(t["g_idx"], qw.g_idx)
    shapes = gptq.packed_shapes(spec_of(qw))
    assert {k_: (tuple(v.shape), v.dtype) for k_, v in t.items()} == shapes
    back = gptq.unpack(t, spec_of(qw))
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.zeros, qw.zeros)
    assert torch.equal(back.scales, qw.scales) and torch.equal(back.g_idx, qw.g_idx)
    assert torch.equal(back.dequantize(), qw.dequantize())


def test_gptq_3bit_is_autogptq_layout():
    qw = make_qw(64, 256, 3, 64, False, seed=3)
    t = gptq.pack(qw)
    expected = torch.tensor(autogptq_pack_3bit(qw.qweight.t().tolist()), dtype=torch.int32)
    assert torch.equal(t["qweight"], expected)


def test_gptq_sym4_zero_words_are_0x77777777():
    t = gptq.pack(make_qw(96, 128, 4, 32, True))
    assert bool((t["qzeros"] == 0x77777777).all())


def test_gptq_asym_zero_0_wraps_and_round_trips():
    qw = make_qw(96, 256, 4, 64, False, with_zero0=True)
    with pytest.warns(UserWarning, match="zero of 0"):
        t = gptq.pack(qw)
    nibble0 = t["qzeros"][0, 0].item() & 0xF  # row 0, group 0 had zero 0
    assert nibble0 == 0xF
    back = gptq.unpack(t, spec_of(qw))
    assert torch.equal(back.zeros, qw.zeros) and torch.equal(back.dequantize(), qw.dequantize())


@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 128), (3, 64), (8, -1)])
def test_gptq_dynamic_act_order_round_trip(bits, gs):
    qw = make_qw(96, 256, bits, gs, False, act_order="dynamic")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = gptq.pack(qw)
    back = gptq.unpack(t, spec_of(qw))
    assert back.act_order == "dynamic" and torch.equal(back.g_idx, qw.g_idx)
    assert torch.equal(back.dequantize(), qw.dequantize())


def test_gptq_missing_g_idx_is_trivial_unless_dynamic():
    qw = make_qw(96, 256, 4, 64, True)
    t = gptq.pack(qw)
    del t["g_idx"]
    assert torch.equal(gptq.unpack(t, spec_of(qw)).g_idx, qw.g_idx)
    with pytest.raises(QuantkitError, match="g_idx"):
        gptq.unpack(t, LinearSpec(96, 256, 4, 64, True, "dynamic"))


# ------------------------------------------------------------ compressed-tensors

def ct_scheme(spec: LinearSpec):
    from compressed_tensors.quantization import QuantizationScheme
    return QuantizationScheme.model_validate(ct.quantization_config({"m": spec}, [], {})["config_groups"]["group_0"])


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("n,k,bits,gs", CASES + [(100, 200, 4, 40), (96, 100, 3, -1), (104, 130, 2, -1)])
def test_compressed_tensors_matches_its_own_packer(n, k, bits, gs, sym):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    qw = make_qw(n, k, bits, gs, sym, seed=n * k + bits)
    t = ct.pack(qw)
    mid = 1 << (bits - 1)
    signed = (qw.qweight.to(torch.int16) - mid).to(torch.int8)
    assert torch.equal(t["weight_packed"], pack_to_int32(signed, bits))
    assert torch.equal(t["weight_packed"], ref_pack_rows(qw.qweight, bits))
    assert torch.equal(unpack_from_int32(t["weight_packed"], bits, torch.Size([n, k])), signed)
    assert t["weight_shape"].tolist() == [n, k]
    assert t["weight_scale"].dtype == torch.float16 and tuple(t["weight_scale"].shape) == (n, qw.n_groups)
    if sym:
        assert "weight_zero_point" not in t
    else:
        zp_signed = (qw.zeros - mid).to(torch.int8)
        assert torch.equal(t["weight_zero_point"], pack_to_int32(zp_signed, bits, packed_dim=0))
        assert torch.equal(t["weight_zero_point"], ref_pack_rows(qw.zeros.t(), bits).t())
        assert torch.equal(unpack_from_int32(t["weight_zero_point"], bits, torch.Size([n, qw.n_groups]),
                                             packed_dim=0), zp_signed)
    assert {k_: (tuple(v.shape), v.dtype) for k_, v in t.items()} == ct.packed_shapes(spec_of(qw))
    back = ct.unpack(t, spec_of(qw))
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.zeros, qw.zeros)
    assert torch.equal(back.dequantize(), qw.dequantize())


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 128), (4, -1), (3, 64), (8, -1), (2, 32)])
def test_compressed_tensors_decompressor_gives_our_weights(bits, gs, sym):
    """compressed-tensors' own decompress() (the path transformers takes) reads what we wrote."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    qw = make_qw(128, 256, bits, gs, sym, seed=bits * 7 + gs)
    t = ct.pack(qw)
    out = PackedQuantizationCompressor.decompress(dict(t), ct_scheme(spec_of(qw)))
    expected = qw.dequantize(torch.float16)
    assert out["weight"].dtype == torch.float16
    torch.testing.assert_close(out["weight"], expected, rtol=0, atol=0)


@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_compressor_writes_what_we_write(sym):
    """Starting from our dequantized weight, compressed-tensors' compress() produces identical tensors."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    qw = make_qw(128, 256, 4, 64, sym, seed=11)
    ours = ct.pack(qw)
    sd = {"weight": qw.dequantize(torch.float32), "weight_scale": qw.scales.clone()}
    if not sym:
        sd["weight_zero_point"] = (qw.zeros - 8).to(torch.int8)
    theirs = PackedQuantizationCompressor.compress(sd, ct_scheme(spec_of(qw)))
    for name in ("weight_packed", "weight_zero_point", "weight_shape"):
        assert (name in theirs) == (name in ours)
        if name in ours:
            assert torch.equal(theirs[name], ours[name]), name


def test_compressed_tensors_refuses_dynamic_act_order():
    qw = make_qw(96, 256, 4, 64, True, act_order="dynamic")
    with pytest.raises(QuantkitError, match="gptq format"):
        ct.pack(qw)
    with pytest.raises(QuantkitError, match="static"):
        ct.packed_shapes(spec_of(qw))


def test_compressed_tensors_refuses_sym_with_other_zeros():
    qw = make_qw(96, 256, 4, 64, True)
    qw.zeros[0, 0] = 3
    with pytest.raises(QuantkitError, match="zero"):
        ct.pack(qw)


# ------------------------------------------------------------ awq

@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("n,k,gs", [(96, 256, 32), (128, 128, 128), (160, 576, 64), (96, 192, -1)])
def test_awq_matches_reference_interleave(n, k, gs, sym):
    qw = make_qw(n, k, 4, gs, sym, seed=n + k)
    t = awq.pack(qw)
    assert set(t) == {"qweight", "qzeros", "scales"}
    assert torch.equal(t["qweight"], ref_awq_pack(qw.qweight.t()))
    assert torch.equal(t["qzeros"], ref_awq_pack(qw.zeros.t()))  # true zero, no minus one
    assert torch.equal(t["scales"].float(), qw.scales.t())
    assert {k_: (tuple(v.shape), v.dtype) for k_, v in t.items()} == awq.packed_shapes(spec_of(qw))
    back = awq.unpack(t, spec_of(qw))
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.zeros, qw.zeros)
    assert torch.equal(back.dequantize(), qw.dequantize())


def test_awq_unpack_order_is_autoawq_reverse_order():
    """AutoAWQ unpacks by shifting out slots then taking [0,4,1,5,2,6,3,7] of each 8 columns."""
    qw = make_qw(64, 128, 4, 64, False)
    t = awq.pack(qw)
    shifts = torch.arange(0, 32, 4)
    slots = ((t["qweight"].unsqueeze(-1) >> shifts) & 0xF).reshape(128, -1)
    reverse = torch.arange(64).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)
    assert torch.equal(slots[:, reverse].t().to(torch.uint8), qw.qweight)


def test_awq_refuses_other_bits_and_dynamic():
    with pytest.raises(QuantkitError, match="4-bit"):
        awq.pack(make_qw(96, 256, 3, 64, False))
    with pytest.raises(QuantkitError, match="gptq"):
        awq.pack(make_qw(96, 256, 4, 64, False, act_order="dynamic"))


# ------------------------------------------------------------ across formats

@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("gs", [32, 128, -1])
def test_all_formats_unpack_to_the_same_weights(gs, sym):
    qw = make_qw(128, 256, 4, gs, sym, seed=5, act_order="static")
    spec = spec_of(qw)
    ws = {}
    for fmt in (gptq, ct, awq):
        ws[fmt.NAME] = fmt.unpack(fmt.pack(qw), spec).dequantize()
    assert torch.equal(ws["gptq"], ws["compressed-tensors"]) and torch.equal(ws["gptq"], ws["awq"])
    assert torch.equal(ws["gptq"], qw.dequantize())


# ------------------------------------------------------------ hostile tensors

def _packed(fmt, sym=False, bits=4):
    qw = make_qw(96, 256, bits, 64, sym)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fmt.pack(qw), spec_of(qw)


@pytest.mark.parametrize("fmt,name", [(gptq, "qweight"), (gptq, "qzeros"), (gptq, "scales"), (gptq, "g_idx"),
                                      (ct, "weight_packed"), (ct, "weight_scale"), (ct, "weight_zero_point"),
                                      (awq, "qweight"), (awq, "qzeros"), (awq, "scales")])
def test_unpack_rejects_bad_shape(fmt, name):
    t, spec = _packed(fmt)
    t[name] = torch.cat([t[name], t[name][:1]])
    with pytest.raises(QuantkitError, match=name):
        fmt.unpack(t, spec)


@pytest.mark.parametrize("fmt,name", [(gptq, "qweight"), (gptq, "scales"), (ct, "weight_packed"),
                                      (ct, "weight_zero_point"), (awq, "qzeros")])
def test_unpack_rejects_bad_dtype_or_missing(fmt, name):
    t, spec = _packed(fmt)
    t2 = dict(t, **{name: t[name].to(torch.uint8)})
    with pytest.raises(QuantkitError, match=name):
        fmt.unpack(t2, spec)
    del t[name]
    with pytest.raises(QuantkitError, match=f"missing tensor '{name}'"):
        fmt.unpack(t, spec)


def test_unpack_rejects_bad_metadata():
    t, spec = _packed(ct)
    t["weight_shape"] = torch.tensor([96, 255])
    with pytest.raises(QuantkitError, match="weight_shape"):
        ct.unpack(t, spec)
    t, spec = _packed(ct, sym=True)
    with pytest.raises(QuantkitError, match="weight_zero_point"):  # extra zero point on a sym scheme
        ct.unpack(dict(t, weight_zero_point=torch.zeros(12, 4, dtype=torch.int32)), spec)
    t, spec = _packed(gptq)
    bad = t["g_idx"].clone()
    bad[0] = 99
    with pytest.raises(QuantkitError, match="g_idx"):
        gptq.unpack(dict(t, g_idx=bad), spec)
    with pytest.raises(QuantkitError, match="g_idx"):  # a permuted g_idx while act-order says none
        gptq.unpack(dict(t, g_idx=t["g_idx"].flip(0)), spec)
    with pytest.raises(QuantkitError, match="g_idx"):  # all zeros (an unfilled buffer) is not a valid map
        gptq.unpack(dict(t, g_idx=torch.zeros(256, dtype=torch.int32)), LinearSpec(96, 256, 4, 64, False, "dynamic"))


def test_shape_constraints_are_clear():
    with pytest.raises(QuantkitError, match="in_features"):
        gptq.packed_shapes(LinearSpec(96, 100, 3, -1))
    with pytest.raises(QuantkitError, match="out_features"):
        awq.packed_shapes(LinearSpec(100, 128, 4, 32))
    with pytest.raises(QuantkitError, match="bits"):
        LinearSpec(96, 128, 9, 32)


# ------------------------------------------------------------ config.json

NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj",
         "model.layers.1.mlp.down_proj", "lm_head"]
SHAPES = {NAMES[0]: (128, 128), NAMES[1]: (128, 256), NAMES[2]: (128, 128), NAMES[3]: (128, 256),
          "lm_head": (512, 128)}


def specs(bits=4, gs=32, sym=True, act="none", override=None):
    out = {n: LinearSpec(*SHAPES[n], bits, gs, sym, act) for n in NAMES[:4]}
    if override:
        out[NAMES[3]] = LinearSpec(*SHAPES[NAMES[3]], *override)
    return out


def test_gptq_config_keys_and_round_trip():
    cfg = gptq.quantization_config(specs(act="dynamic"), ["lm_head"], {"damp_percent": 0.05})
    for key, val in dict(quant_method="gptq", bits=4, group_size=32, desc_act=True, sym=True, static_groups=False,
                         true_sequential=True, damp_percent=0.05, checkpoint_format="gptq").items():
        assert cfg[key] == val, key
    assert "dynamic" not in cfg and cfg["lm_head"] is False
    assert gptq.parse_quantization_config(cfg, NAMES, SHAPES) == specs(act="dynamic")
    cfg = gptq.quantization_config(specs(act="static"), ["lm_head"], {})
    # act-order over static groups stores the trivial g_idx: loaders are told desc_act false (vLLM refuses
    # desc_act true), quantkit's own act_order key keeps the processing order
    assert cfg["desc_act"] is False and cfg["static_groups"] is True and cfg["act_order"] == "static"
    assert gptq.parse_quantization_config(cfg, NAMES, SHAPES) == specs(act="static")


def test_gptq_config_reads_checkpoints_without_act_order_key():
    """Older quantkit, GPTQModel and AutoGPTQ configs carry no act_order: desc_act + static_groups decide."""
    base = {k: v for k, v in gptq.quantization_config(specs(), ["lm_head"], {}).items() if k != "act_order"}
    for desc, static, want in ((True, True, "static"), (True, False, "dynamic"), (False, True, "none"),
                               (False, False, "none")):
        cfg = dict(base, desc_act=desc, static_groups=static)
        assert gptq.parse_quantization_config(cfg, NAMES, SHAPES) == specs(act=want), (desc, static)
    for recorded, desc in (("dynamic", False), ("none", True), ("sorted", False)):
        with pytest.raises(QuantkitError, match="act_order"):
            gptq.parse_quantization_config(dict(base, act_order=recorded, desc_act=desc), NAMES, SHAPES)


def test_gptq_config_mixed_and_ignored_modules_use_dynamic_rules():
    want = specs(override=(8, -1, False, "none"))
    del want[NAMES[2]]
    cfg = gptq.quantization_config(want, [NAMES[2], "lm_head"], {})
    assert cfg["dynamic"] == {r"+:^model\.layers\.1\.mlp\.down_proj$": {"bits": 8, "group_size": -1, "sym": False,
                                                                        "desc_act": False, "static_groups": False,
                                                                        "act_order": "none"},
                              r"-:^model\.layers\.1\.self_attn\.q_proj$": {}}
    assert gptq.parse_quantization_config(cfg, NAMES, SHAPES) == want


def test_gptq_config_rejects_other_checkpoints():
    base = gptq.quantization_config(specs(), ["lm_head"], {})
    for bad in (dict(base, checkpoint_format="gptq_v2"), dict(base, quant_method="awq"), dict(base, bits=5),
                dict(base, bits=None)):
        with pytest.raises(QuantkitError):
            gptq.parse_quantization_config(bad, NAMES, SHAPES)
    with pytest.raises(QuantkitError, match="desc_act"):
        gptq.quantization_config(specs(act="dynamic"), [], {"desc_act": False})


def _ct_validate(cfg):
    from compressed_tensors.quantization import QuantizationConfig
    body = {k: v for k, v in cfg.items() if k not in ("version", "sparsity_config", "transform_config")}
    return QuantizationConfig.model_validate(body)


def test_compressed_tensors_config_is_valid_and_round_trips():
    want = specs(sym=False, act="static")
    cfg = ct.quantization_config(want, ["lm_head"], {})
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "pack-quantized"
    assert cfg["quantization_status"] == "compressed" and cfg["ignore"] == ["lm_head"]
    assert cfg["version"] == "0.20.1"
    w = cfg["config_groups"]["group_0"]["weights"]
    assert w == {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32,
                 "actorder": "weight", "dynamic": False, "observer": "minmax"}
    parsed = _ct_validate(cfg)
    assert parsed.config_groups["group_0"].weights.actorder == "weight"
    assert ct.parse_quantization_config(cfg, NAMES, SHAPES) == want


def test_compressed_tensors_config_mixed_schemes():
    want = specs(override=(8, -1, True, "none"))
    cfg = ct.quantization_config(want, ["lm_head"], {})
    assert cfg["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert cfg["config_groups"]["group_1"]["targets"] == [NAMES[3]]
    assert cfg["config_groups"]["group_1"]["weights"]["strategy"] == "channel"
    _ct_validate(cfg)
    assert ct.parse_quantization_config(cfg, NAMES, SHAPES) == want
    # regexes rank between exact names and classes, as in compressed-tensors' matcher
    cfg["config_groups"]["group_1"]["targets"] = ["re:.*down_proj$"]
    got = ct.parse_quantization_config(cfg, NAMES, SHAPES)
    assert got[NAMES[1]].bits == 8 and got[NAMES[0]].bits == 4


def test_compressed_tensors_config_rejections():
    cfg = ct.quantization_config(specs(), ["lm_head"], {})
    bad_actorder = {**cfg, "config_groups": {"group_0": {**cfg["config_groups"]["group_0"],
                    "weights": {**cfg["config_groups"]["group_0"]["weights"], "actorder": "group"}}}}
    with pytest.raises(QuantkitError, match="gptq format"):
        ct.parse_quantization_config(bad_actorder, NAMES, SHAPES)
    with pytest.raises(QuantkitError, match="gptq format"):
        ct.quantization_config(specs(act="dynamic"), [], {})
    with pytest.raises(QuantkitError, match="int-quantized"):
        ct.parse_quantization_config({**cfg, "format": "int-quantized",
                                      "config_groups": {"g": {**cfg["config_groups"]["group_0"], "format": None}}},
                                     NAMES, SHAPES)
    with pytest.raises(QuantkitError, match="quantization_status"):
        ct.parse_quantization_config({**cfg, "quantization_status": "frozen"}, NAMES, SHAPES)


def test_awq_config_round_trip_and_rejections():
    want = specs(bits=4, gs=128, sym=False)
    cfg = awq.quantization_config(want, ["lm_head"], {})
    assert cfg == {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
                   "modules_to_not_convert": ["lm_head"]}
    assert awq.parse_quantization_config(cfg, NAMES, SHAPES) == want
    with pytest.raises(QuantkitError, match="one scheme"):
        awq.quantization_config(specs(override=(4, 64, False, "none")), [], {})
    for bad in ({**cfg, "version": "gemv"}, {**cfg, "bits": 8}):
        with pytest.raises(QuantkitError):
            awq.parse_quantization_config(bad, NAMES, SHAPES)
    # zero_point false (GPTQModel's symmetric AWQ GEMM): the same layout, read as symmetric
    assert awq.parse_quantization_config({**cfg, "zero_point": False}, NAMES, SHAPES) == specs(bits=4, gs=128, sym=True)


def test_awq_zero_point_false_reads_its_stored_zeros_of_8_as_symmetric():
    """A symmetric weight packed with zeros of 8 (as GPTQModel writes zero_point false) unpacks to the
    same codes and dequantized values under a symmetric spec; a stored zero other than 8 is refused,
    since the config's zero_point false would then misdescribe the file."""
    qw = make_qw(96, 256, 4, 64, True, seed=5)
    assert bool((qw.zeros == 8).all())
    t = awq.pack(qw)
    back = awq.unpack(t, spec_of(qw))
    assert back.sym and torch.equal(back.qweight, qw.qweight)
    assert torch.equal(back.dequantize(), ((qw.qweight.float() - 8) * qw.scales.repeat_interleave(64, 1)))
    asym = make_qw(96, 256, 4, 64, False, seed=5)
    assert bool((asym.zeros != 8).any())
    with pytest.raises(QuantkitError, match="zero_point false"):
        awq.unpack(awq.pack(asym), spec_of(qw))


def test_registry():
    assert get_format("gptq") is gptq and get_format("compressed_tensors") is ct and get_format("AWQ") is awq
    assert format_for_quant_method({"quant_method": "compressed-tensors"}) is ct
    with pytest.raises(QuantkitError, match="unknown checkpoint format"):
        get_format("gguf")
    with pytest.raises(QuantkitError, match="bitsandbytes"):
        format_for_quant_method({"quant_method": "bitsandbytes"})
