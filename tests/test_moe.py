"""Mixture-of-Experts models: per-expert calibration, the few-token policy, checkpoints and loading.

Tiny random models of every MoE family quantkit supports, built here. The oracles are independent of
the code under test: transformers' own fused experts forward, a plain column-by-column GPTQ
(test_gptq_core.plain_gptq) run on the tokens the test routes itself, and dequantization written in
this file from the on-disk layouts, put back into transformers' fused expert parameters.
"""
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import quantkit
from conftest import interrupt_after_first_layer, perturb_norms
from quantkit.errors import QuantkitError
from quantkit.models import get_adapter
from quantkit.models.experts import RoutedExperts
from quantkit.pipeline import quantize_model
from quantkit.pipeline.experts import ExpertPolicy, experts_unfused
from quantkit.quantizers.base import get_quantizer
from quantkit.scheme import LinearScheme, QuantScheme
from test_gptq_core import assert_codes_match, hessian_of, plain_gptq

VOCAB = 49152  # the demo tokenizer's, so `quantize` can calibrate on real text
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, num_experts_per_tok=2)
DEEPSEEK_V3 = dict(**{**COMMON, "num_key_value_heads": 4}, moe_intermediate_size=32, intermediate_size=96,
                   n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                   kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=96, num_local_experts=4),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, intermediate_size=96,
                                                     shared_expert_intermediate_size=64, num_experts=4,
                                                     mlp_only_layers=[0]),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=4,
                                                     norm_topk_prob=True, head_dim=16),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**DEEPSEEK_V3),
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=4, eos_token_id=None),
}
FAMILIES = sorted(CONFIGS)


def build(family: str, seed: int = 0, config=None):
    """A random model (of `config`, else the family's) with eager experts; routers re-drawn with std 1 (the
    0.02 init routes by near-ties, which the smallest rounding flips) and norms perturbed (so folding into
    them is really tested)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config or CONFIGS[family](), dtype=torch.float32,
                                             experts_implementation="eager")
    model.eval()
    perturb_norms(model)
    adapter = get_adapter(model)
    with torch.no_grad():
        for layer in adapter.decoder_layers(model):
            for block in adapter.moe_blocks(layer):
                layer.get_submodule(block.router).weight.normal_(0.0, 1.0)
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, demo_dir):
    made = {}

    def get(family: str) -> Path:
        if family not in made:
            out = tmp_path_factory.mktemp(family)
            build(family).save_pretrained(out)
            transformers.AutoTokenizer.from_pretrained(demo_dir).save_pretrained(out)
            made[family] = out
        return made[family]

    return get


def ids(n=2, t=16, seed=0):
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ the per-expert stand-in

@pytest.mark.parametrize("family", FAMILIES)
def test_per_expert_linears_compute_what_the_fused_experts_compute(family):
    """The swapped-in per-expert linears give the MoE block's output of transformers' own fused experts,
    routed and with every token through every expert; and the fused weights come back untouched."""
    model = build(family)
    adapter = get_adapter(model)
    layer = adapter.decoder_layers(model)[-1]
    block = adapter.moe_blocks(layer)[0]
    mlp = layer.get_submodule(block.module)
    x = torch.randn(3, 20, 64, generator=torch.Generator().manual_seed(2))
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    with torch.no_grad():
        reference = mlp(x)
        for mode in ("routed", "all"):
            with experts_unfused(layer, adapter, ExpertPolicy(mode=mode), calibrated=True) as experts:
                assert isinstance(layer.get_submodule(block.experts), RoutedExperts)
                assert experts.blocks[0].routed.route_all_tokens == (mode == "all")
                torch.testing.assert_close(mlp(x), reference, rtol=1e-6, atol=1e-7)
    assert type(layer.get_submodule(block.experts)).__name__.endswith("Experts")
    for k, v in mlp.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_names_every_linear_the_layer_runs(family):
    """Stages cover exactly the quantizable linears of each (swapped) layer and every one of them runs;
    linear_shapes names the per-expert linears with their real shapes before any swap."""
    model = build(family)
    adapter = get_adapter(model)
    shapes = adapter.linear_shapes(model)
    for i, layer in enumerate(adapter.decoder_layers(model)):
        with experts_unfused(layer, adapter, ExpertPolicy(mode="all"), calibrated=True):
            names = adapter.linear_names(layer)
            staged = [n for stage in adapter.sequential_stages(layer) for n in stage]
            quantizable = [n for n in names if f"model.layers.{i}.{n}" in shapes]
            assert sorted(staged) == sorted(quantizable)
            for n in names:
                m = layer.get_submodule(n)
                if f"model.layers.{i}.{n}" in shapes:
                    assert shapes[f"model.layers.{i}.{n}"] == (m.out_features, m.in_features), n
            ran = set()
            hooks = [layer.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: ran.add(n)) for n in names]
            with torch.no_grad():
                model(ids(1, 24))
            for h in hooks:
                h.remove()
            assert ran == set(names)
    # routers and shared-expert gates are never quantization targets
    for name in adapter.full_precision_modules(model):
        assert name not in shapes


@pytest.mark.parametrize("family", FAMILIES)
def test_awq_scales_fold_into_the_router_too(family):
    """AWQ's scale on the post-attention norm reaches every consumer of the normed input, the router
    included: with clipping off the transform is exact, so the logits do not move."""
    from quantkit.pipeline.driver import transform_model
    from quantkit.quantizers.awq import AWQTransform

    model = build(family)
    adapter = get_adapter(model)
    layer = adapter.decoder_layers(model)[-1]
    router = layer.get_submodule(adapter.moe_blocks(layer)[0].router).weight.detach().clone()
    calib = ids(4, 32, seed=1)
    with torch.no_grad():
        before = model(calib).logits
    awq = AWQTransform(clip=False)
    transform_model(model, awq, calib, batch_size=2)
    moe_group = next(g for g in awq.search_log[1]["groups"] if g["prev"] == "post_attention_layernorm")
    assert moe_group["alpha"] > 0 and len(moe_group["linears"]) >= 8  # a real scale over every expert
    assert not torch.equal(layer.get_submodule(adapter.moe_blocks(layer)[0].router).weight, router)
    with torch.no_grad():
        torch.testing.assert_close(model(calib).logits, before, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ calibration

def _layer0_moe_model():
    """Qwen3-MoE whose layer 0 is the only one quantized: its MoE input is exactly the float model's."""
    model = build("qwen3_moe")
    adapter = get_adapter(model)
    shapes = adapter.linear_shapes(model)
    scheme = QuantScheme(bits=4, group_size=32, sym=True, ignore=(r"^(?!model\.layers\.0\.mlp\.experts\.)",))
    return model, adapter, scheme.resolve(shapes)


def test_per_expert_gptq_equals_plain_gptq_on_that_experts_routed_tokens():
    model, adapter, schemes = _layer0_moe_model()
    calib = ids(4, 48, seed=3)
    captured = {}
    mlp = model.model.layers[0].mlp

    def keep_input(module, args):
        captured["x"] = args[0].reshape(-1, 64).clone()

    hook = mlp.register_forward_pre_hook(keep_input)
    with torch.no_grad():
        model(calib)
        hook.remove()
        x = captured["x"]
        _, _, top_k = mlp.gate(x)
    gptq = get_quantizer("gptq", desc_act=False, static_groups=False, mse=False)
    results = quantize_model(model, adapter, gptq, schemes, calib, batch_size=2, progress=False,
                             experts=ExpertPolicy(mode="routed", min_tokens=1))
    fused = build("qwen3_moe").model.layers[0].mlp.experts  # the original weights
    i = fused.intermediate_dim
    for e in range(fused.num_experts):
        rows = (top_k == e).any(dim=1)
        assert rows.any(), "every expert should see tokens here"
        xe = x[rows]
        w_gate_up = fused.gate_up_proj[e].detach()
        codes, q = plain_gptq(w_gate_up, hessian_of(xe), 4, 32, True)
        name = f"model.layers.0.mlp.experts.{e}."
        assert_codes_match(results[name + "gate_proj"], codes[:i], q[:i], f"gate {e}")
        assert_codes_match(results[name + "up_proj"], codes[i:], q[i:], f"up {e}")
        # down sees the quantized gate/up's product (true-sequential)
        h = fused.act_fn(xe @ results[name + "gate_proj"].dequantize().T) * (xe @ results[name + "up_proj"].dequantize().T)
        codes, q = plain_gptq(fused.down_proj[e].detach(), hessian_of(h), 4, 32, True)
        assert_codes_match(results[name + "down_proj"], codes, q, f"down {e}")


def _never_routed_deepseek(tmp_path, demo_dir) -> Path:
    """DeepSeek-V3 whose score-correction bias keeps expert 3 from ever being chosen."""
    model = build("deepseek_v3")
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias[3] = -100.0
    out = tmp_path / "ds"
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(demo_dir).save_pretrained(out)
    return out


def test_expert_without_tokens_falls_back_to_rtn_visibly_and_all_calibrates_every_expert(tmp_path, demo_dir):
    src = _never_routed_deepseek(tmp_path, demo_dir)
    routed = quantkit.quantize(str(src), "gptq", bits=4, group_size=32, output=tmp_path / "routed", num_samples=4,
                               seq_len=32, progress=False, moe_calibration="routed")
    layer = routed["moe"]["layers"]["model.layers.1.mlp.experts"]
    assert layer["tokens_min"] == 0 and layer["uncalibrated"] == ["model.layers.1.mlp.experts.3"]
    assert "`model.layers.1.mlp.experts.3`" in (tmp_path / "routed" / "README.md").read_text()
    report = json.loads((tmp_path / "routed" / "moe_calibration.json").read_text())
    assert report["per_expert"]["model.layers.1.mlp.experts"]["routed_tokens"][3] == 0
    # the uncalibrated expert is a real RTN of its weights: finite, non-zero, and what `--method rtn`
    # writes for that weight (GPTQ's default range search, mse, is RTN's default too)
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).model.layers[1].mlp.experts
    loaded = quantkit.load(tmp_path / "routed", backend="reference", dtype="float32")
    i = original.intermediate_dim
    rtn = get_quantizer("rtn")
    for proj, w in (("gate_proj", original.gate_up_proj[3, :i]), ("up_proj", original.gate_up_proj[3, i:]),
                    ("down_proj", original.down_proj[3])):
        qw = loaded.get_submodule(f"model.layers.1.mlp.experts.3.{proj}").quantized_weight()
        deq = qw.dequantize()
        assert torch.isfinite(deq).all() and deq.abs().sum() > 0
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data = w.detach().clone()
        want = rtn.quantize_linear(proj, lin, LinearScheme(bits=4, group_size=32, sym=qw.sym))
        assert torch.equal(qw.qweight.to(torch.uint8), want.qweight) and torch.equal(qw.scales.float(), want.scales.float()), proj
        # within half a step of the weight wherever the range search did not clamp it
        step = qw.scales.repeat_interleave(32, dim=1)
        inside = deq.abs() < 7 * step
        assert ((deq - w.detach()).abs()[inside] <= step[inside] * 0.51).all(), proj
    # all: every expert calibrated on every calibration token, none left uncalibrated
    everything = quantkit.quantize(str(src), "gptq", bits=4, group_size=32, output=tmp_path / "all", num_samples=4,
                                   seq_len=32, progress=False, moe_calibration="all")
    layer = everything["moe"]["layers"]["model.layers.1.mlp.experts"]
    assert layer["tokens_min"] == layer["tokens_max"] == 4 * 32 and layer["uncalibrated"] == []
    per_expert = everything["moe"]["per_expert"]["model.layers.1.mlp.experts"]
    assert per_expert["calibration_tokens"] == [128] * 8 and per_expert["routed_tokens"][3] == 0


# ------------------------------------------------------------------------------ checkpoints

def _unpack_along(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> unsigned codes, value j of a word at bits j*b.., stacked along `dim`."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    w = words.unsqueeze(dim + 1) >> shifts.view(*([1] * (dim + 1)), -1, *([1] * (words.dim() - dim - 1)))
    w = w & ((1 << bits) - 1)
    shape = list(words.shape)
    shape[dim] *= 32 // bits
    return w.reshape(shape)


def dequantize_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Every quantized linear of a gptq or compressed-tensors (pack-quantized, symmetric) checkpoint,
    dequantized from the file's tensors with the layouts' published rules."""
    cfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    tensors = load_file(str(folder / "model.safetensors"))
    out = {}
    if cfg["quant_method"] == "gptq":
        bits = cfg["bits"]
        for key in [k for k in tensors if k.endswith(".qweight")]:
            name = key[:-len(".qweight")]
            q = _unpack_along(tensors[key], bits, 0).float()  # [K, N]
            z = _unpack_along(tensors[name + ".qzeros"], bits, 1).float() + 1  # v1 stores zero - 1
            s, g = tensors[name + ".scales"].float(), tensors[name + ".g_idx"].long()
            out[name] = (s[g] * (q - z[g])).T
    else:
        group = cfg["config_groups"]["group_0"]["weights"]
        bits, gs = group["num_bits"], group["group_size"]
        assert group["symmetric"]
        for key in [k for k in tensors if k.endswith(".weight_packed")]:
            name = key[:-len(".weight_packed")]
            q = _unpack_along(tensors[key], bits, 1).float()  # [N, K]
            s = tensors[name + ".weight_scale"].float().repeat_interleave(gs, dim=1)
            out[name] = s * (q - (1 << (bits - 1)))
    return out


def oracle_model(source: Path, folder: Path):
    """The original transformers model with every quantized weight replaced by the checkpoint's
    dequantized values, experts written back into the fused [E, 2I, H] / [E, H, I] parameters."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, experts_implementation="eager").eval()
    mixtral = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    with torch.no_grad():
        for name, w in dequantize_checkpoint(folder).items():
            name = name.replace(".block_sparse_moe.", ".mlp.")
            parts = name.split(".")
            if "experts" in parts:
                at = parts.index("experts")
                experts = model.get_submodule(".".join(parts[:at + 1]))
                e, proj = int(parts[at + 1]), mixtral.get(parts[at + 2], parts[at + 2])
                i = experts.intermediate_dim
                target = {"gate_proj": experts.gate_up_proj[e, :i], "up_proj": experts.gate_up_proj[e, i:],
                          "down_proj": experts.down_proj[e]}[proj]
            else:
                target = model.get_submodule(name).weight
            assert target.shape == w.shape, name
            target.copy_(w)
    return model


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
@pytest.mark.parametrize("method", ["rtn", "gptq"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_checkpoint_loads_and_matches_a_dequantize_into_transformers_oracle(model_dir, tmp_path, family,
                                                                                      method, fmt):
    source = model_dir(family)
    out = tmp_path / "q"
    calibration = {} if method == "rtn" else {"num_samples": 4, "seq_len": 32}
    quantkit.quantize(str(source), method, bits=8, group_size=32, format=fmt, output=out, progress=False, **calibration)
    keys = load_file(str(out / "model.safetensors")).keys()
    assert not any("gate_up_proj" in k or k.endswith("experts.down_proj") for k in keys)  # never fused 3-D names
    if family == "mixtral":
        assert any(".block_sparse_moe.experts.0.w1." in k for k in keys)
    tokens = ids(2, 20, seed=5)
    with torch.no_grad():
        ours = quantkit.load(out, backend="reference", dtype="float32")(tokens).logits
        oracle = oracle_model(source, out)(tokens).logits
    cos = torch.nn.functional.cosine_similarity(ours.flatten(), oracle.flatten(), dim=0)
    assert cos > 0.99999
    assert torch.equal(ours.argmax(-1), oracle.argmax(-1))


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_compressed_tensors_moe_checkpoint_loads_in_transformers(model_dir, tmp_path, family):
    """transformers with compressed-tensors decompresses our per-expert tensors into its fused experts
    (into fp16, the scales' dtype) and computes what quantkit.load computes."""
    pytest.importorskip("compressed_tensors")
    from quantkit.runtime import QuantLinear

    out = tmp_path / "ct"
    quantkit.quantize(str(model_dir(family)), "gptq", bits=4, group_size=32, format="compressed-tensors", output=out,
                      num_samples=4, seq_len=32, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = quantkit.load(out, backend="reference", dtype="float32")
    experts = hf.model.layers[1].mlp.experts
    i = experts.gate_up_proj.shape[1] // 2
    for e in range(experts.gate_up_proj.shape[0]):
        qw = ours.get_submodule(f"model.layers.1.mlp.experts.{e}.gate_proj")
        assert isinstance(qw, QuantLinear)
        assert torch.equal(experts.gate_up_proj[e, :i], qw.quantized_weight().dequantize().to(experts.gate_up_proj.dtype))
    tokens = ids(2, 20, seed=6)
    with torch.no_grad():
        a, b = hf(tokens).logits, ours(tokens).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99999
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_quantization_config_keeps_routers_and_shared_expert_gates_in_full_precision(model_dir, tmp_path):
    out = tmp_path / "q"
    quantkit.quantize(str(model_dir("qwen2_moe")), "rtn", bits=4, group_size=32, output=out, progress=False)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    skipped = {k for k in cfg.get("dynamic", {}) if k.startswith("-:")}
    assert r"-:^model\.layers\.1\.mlp\.gate$" in skipped
    assert r"-:^model\.layers\.1\.mlp\.shared_expert_gate$" in skipped
    keys = load_file(str(out / "model.safetensors"))
    assert keys["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the source's dtype, unquantized
    assert "model.layers.1.mlp.shared_expert.gate_proj.qweight" in keys


def test_vllm_moe_kernel_verdicts():
    """What vLLM's fused-MoE kernels take (read from vLLM's marlin_utils / moe_wna16): the checkpoint
    says so instead of leaving the user to find out at serving time."""
    from quantkit.formats.spec import LinearSpec
    from quantkit.formats.vllm_moe import MARLIN, WNA16, moe_kernel

    def spec(bits=4, gs=128, sym=True, act="none"):
        return LinearSpec(512, 256, bits, gs, sym, act_order=act)

    assert moe_kernel("gptq", spec(), 512, 256)[0] == MARLIN
    assert moe_kernel("gptq", spec(act="static"), 512, 256)[0] == MARLIN  # Marlin MoE takes act-order
    assert moe_kernel("compressed-tensors", spec(bits=8, gs=-1), 512, 256)[0] == MARLIN
    assert moe_kernel("gptq", spec(bits=3), 512, 256) == (None, "vLLM's MoE kernels take 4- and 8-bit experts, not 3-bit")
    assert moe_kernel("gptq", spec(sym=False), 512, 256)[0] == WNA16  # Marlin gptq is symmetric only
    assert moe_kernel("gptq", spec(act="static"), 512, 96)[0] is None  # off Marlin's shapes, act-order on
    assert moe_kernel("gptq", spec(bits=8, gs=64), 576, 96)[0] is None
    w8a8 = LinearSpec(512, 256, 8, -1, True, input_quant="token")
    assert moe_kernel("compressed-tensors", w8a8, 512, 256)[0] == "w8a8_int8"
    assert moe_kernel("compressed-tensors", LinearSpec(512, 256, 8, -1, True, input_quant="tensor"), 512, 256)[0] is None


# ------------------------------------------------------------------------------ the CLI and the plan

def test_cli_json_and_inspect_show_tokens_per_expert(model_dir, tmp_path):
    from click.testing import CliRunner

    from quantkit.cli import cli

    out = tmp_path / "q"
    runner = CliRunner()
    r = runner.invoke(cli, ["quantize", "--model", str(model_dir("olmoe")), "--method", "gptq", "--bits", "4",
                            "--group-size", "32", "--num-samples", "4", "--seq-len", "32", "--moe-calibration", "routed",
                            "--moe-min-tokens", "100000", "--output", str(out), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output.strip().splitlines()[-1])
    layer = summary["moe"]["layers"]["model.layers.0.mlp.experts"]
    assert summary["moe"]["calibration"] == "routed" and summary["moe"]["min_tokens"] == 100000
    assert len(layer["uncalibrated"]) == 4  # every expert is under that threshold
    r = runner.invoke(cli, ["inspect", "--model", str(out)])
    assert r.exit_code == 0, r.output
    assert "experts calibrated: routed" in r.output and "model.layers.1.mlp.experts: 4 experts" in r.output


def test_moe_settings_are_refused_where_they_mean_nothing(model_dir, tiny_llama_dir, tmp_path):
    with pytest.raises(QuantkitError, match="no experts"):
        quantkit.quantize(str(tiny_llama_dir), "gptq", output=tmp_path / "a", num_samples=2, seq_len=16,
                          progress=False, moe_calibration="all")
    with pytest.raises(QuantkitError, match="reads no calibration data"):
        quantkit.quantize(str(model_dir("olmoe")), "rtn", output=tmp_path / "b", progress=False, moe_calibration="all")
    with pytest.raises(QuantkitError, match="moe-calibration"):
        quantkit.quantize(str(model_dir("olmoe")), "gptq", output=tmp_path / "c", progress=False,
                          moe_calibration="some")
    with pytest.raises(QuantkitError, match="GGUF"):
        quantkit.quantize(str(model_dir("olmoe")), "rtn", format="gguf", output=tmp_path / "d", progress=False)


# ------------------------------------------------------------------------------ the engine

@pytest.mark.parametrize("family", FAMILIES)
def test_engine_routing_is_each_familys_own(family):
    """The engine's routing (softmax top-k with the family's renormalisation, DeepSeek's sigmoid
    group-limited top-k with its score bias and routed_scaling_factor) picks the experts transformers'
    router picks, with the same weights."""
    from quantkit.engine.moe import sigmoid_grouped_topk, softmax_topk
    from quantkit.models.layout import SIGMOID_GROUPED

    model = build(family)
    adapter = get_adapter(model)
    layer = adapter.decoder_layers(model)[-1]
    router = layer.get_submodule(adapter.moe_blocks(layer)[0].router)
    layout = adapter.moe_layout(model.config)
    if family == "deepseek_v3":
        with torch.no_grad():
            router.e_score_correction_bias.normal_(0.0, 0.1)  # a real bias, so ignoring it would show
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, want_w, want_i = router(x)
        logits = torch.nn.functional.linear(x, router.weight)
        if layout.scoring == SIGMOID_GROUPED:
            got_w, got_i = sigmoid_grouped_topk(logits, router.e_score_correction_bias, layout.top_k, layout.n_group,
                                                layout.topk_group, layout.renormalize, layout.scaling)
        else:
            got_w, got_i = softmax_topk(logits, layout.top_k, layout.renormalize)
    order_want, order_got = want_i.sort(dim=-1), got_i.sort(dim=-1)
    assert torch.equal(order_want.values, order_got.values)
    torch.testing.assert_close(got_w.gather(1, order_got.indices), want_w.float().gather(1, order_want.indices),
                               rtol=1e-6, atol=1e-7)


def _engine_tokens(model, prompts_, n):
    from quantkit.engine import LLMEngine, SamplingParams

    engine = LLMEngine(model, block_size=4, num_kv_blocks=64, max_num_seqs=2)
    return [g["token_ids"] for g in engine.generate(prompts_, SamplingParams(temperature=0.0, max_tokens=n))]


def _hf_tokens(model, prompts_, n):
    out = []
    for p in prompts_:
        x = torch.tensor([p])
        out.append(model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                  pad_token_id=0)[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_tokens_equal_transformers_generate(model_dir, tmp_path, family):
    """On the unquantized model, and on an 8-bit checkpoint (quantkit.load, per-expert QuantLinears)
    against transformers on the dequantize-into-transformers oracle of that checkpoint."""
    prompts_ = [ids(1, n, seed=10 + n)[0].tolist() for n in (5, 13, 9)]
    source = model_dir(family)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    assert _engine_tokens(model, prompts_, 8) == _hf_tokens(model, prompts_, 8)
    out = tmp_path / "q"
    quantkit.quantize(str(source), "rtn", bits=8, group_size=32, output=out, progress=False)
    loaded = quantkit.load(out, backend="reference", dtype="float32")
    assert _engine_tokens(loaded, prompts_, 8) == _hf_tokens(oracle_model(source, out), prompts_, 8)


def test_convert_repacks_moe_checkpoints_and_round_trips_bytes(model_dir, tmp_path):
    from quantkit.convert import convert

    gptq = tmp_path / "gptq"
    quantkit.quantize(str(model_dir("mixtral")), "rtn", bits=4, group_size=32, output=gptq, progress=False)
    convert(gptq, "compressed-tensors", tmp_path / "ct")
    convert(tmp_path / "ct", "gptq", tmp_path / "back")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (gptq / "model.safetensors").read_bytes()
    tokens = ids(1, 12, seed=7)
    with torch.no_grad():
        a = quantkit.load(gptq, backend="reference", dtype="float32")(tokens).logits
        b = quantkit.load(tmp_path / "ct", backend="reference", dtype="float32")(tokens).logits
    assert torch.equal(a, b)
    with pytest.raises(QuantkitError, match="GGUF"):
        convert(gptq, "gguf", tmp_path / "g")


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_smoothquant_smoothing_reaches_the_router_and_keeps_the_function(family):
    """SmoothQuant's scale on the post-attention norm, read at the MoE block's input (an expert sees only
    its tokens), folds into every expert, the shared expert and the router: the smoothed model computes
    what the original did."""
    from quantkit.pipeline.driver import transform_model
    from quantkit.quantizers.smoothquant import SmoothQuantTransform

    model = build(family)
    calib = ids(4, 32, seed=8)
    router = model.model.layers[1].mlp.gate.weight
    original_router = router.detach().clone()
    with torch.no_grad():
        before = model(calib).logits
    sq = SmoothQuantTransform()
    transform_model(model, sq, calib, batch_size=2)
    assert not torch.allclose(router, original_router)  # a real scale went into it
    with torch.no_grad():
        torch.testing.assert_close(model(calib).logits, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_streamed_moe_run_writes_the_in_memory_bytes(model_dir, tmp_path, family):
    """`--streaming` reads each layer's per-expert tensors (named as the family's checkpoints name them, e.g.
    Mixtral's block_sparse_moe.experts.N.w1) and fuses them as from_pretrained does (`streaming.LazyLayers`);
    GPTQ per expert on its routed tokens then writes what the in-memory run writes, token counts included."""
    args = dict(num_samples=4, seq_len=32, progress=False, bits=4, group_size=32)
    src = str(model_dir(family))
    memory = quantkit.quantize(src, "gptq", output=tmp_path / "memory", streaming=False, **args)
    streamed = quantkit.quantize(src, "gptq", output=tmp_path / "streamed", streaming=True, **args)
    assert streamed["streaming"] and not memory["streaming"]
    assert streamed["moe"]["layers"] == memory["moe"]["layers"]
    files = sorted(p.name for p in (tmp_path / "memory").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "streamed").iterdir())
    for f in files:
        assert (tmp_path / "streamed" / f).read_bytes() == (tmp_path / "memory" / f).read_bytes(), f


def test_moe_resume_restores_experts_and_their_counts_byte_for_byte(model_dir, tmp_path, monkeypatch):
    """Interrupted after layer 0: the resumed run restores that layer's per-expert results and token
    counts from the progress record and writes the same bytes as an uninterrupted run."""
    args = dict(num_samples=4, seq_len=32, progress=False, moe_calibration="routed", moe_min_tokens=40)
    src = str(model_dir("olmoe"))
    ref = quantkit.quantize(src, "gptq", bits=4, group_size=32, output=tmp_path / "ref", **args)
    interrupt_after_first_layer(
        monkeypatch, lambda: quantkit.quantize(src, "gptq", bits=4, group_size=32, output=tmp_path / "out", **args))
    resumed = quantkit.quantize(src, "gptq", bits=4, group_size=32, output=tmp_path / "out", resume=True, **args)
    assert resumed["moe"]["layers"] == ref["moe"]["layers"]
    for f in ("model.safetensors", "README.md", "moe_calibration.json", "config.json"):
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f


@pytest.mark.parametrize("method", ["gptq", "smoothquant,gptq"])
def test_a_float_moe_run_resumes_to_the_same_bytes(model_dir, tmp_path, monkeypatch, method):
    """NVFP4 (static input scales, some experts never routed to) interrupted after layer 0's record (inside
    the SmoothQuant pass for the second method): the resumed run restores the per-expert float results and
    their input absmax and writes the uninterrupted run's bytes."""
    args = dict(scheme="NVFP4", num_samples=4, seq_len=32, progress=False)
    src = str(model_dir("qwen3_moe"))
    quantkit.quantize(src, method, output=tmp_path / "ref", **args)
    interrupt_after_first_layer(monkeypatch, lambda: quantkit.quantize(src, method, output=tmp_path / "out", **args))
    assert (tmp_path / ".out.partial").is_dir()
    quantkit.quantize(src, method, output=tmp_path / "out", resume=True, **args)
    for f in ("model.safetensors", "README.md", "config.json"):
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f


def test_awq_checkpoint_of_a_moe_model_loads_with_its_folded_router(model_dir, tmp_path):
    """AWQ in its own layout: per-expert GEMM tensors under Mixtral's names, the router (carrying the
    folded scale) kept in full precision and declared so, and the model still computes the original."""
    source = model_dir("mixtral")
    out = tmp_path / "awq"
    quantkit.quantize(str(source), "awq", bits=4, group_size=32, output=out, num_samples=4, seq_len=32, progress=False)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "awq" and "model.layers.1.block_sparse_moe.gate" in cfg["modules_to_not_convert"]
    tensors = load_file(str(out / "model.safetensors"))
    assert "model.layers.1.block_sparse_moe.experts.3.w2.qweight" in tensors
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    assert not torch.allclose(tensors["model.layers.1.block_sparse_moe.gate.weight"].float(),
                              original.model.layers[1].mlp.gate.weight)
    tokens = ids(2, 16, seed=9)
    with torch.no_grad():
        a = quantkit.load(out, backend="reference", dtype="float32")(tokens).logits
        b = original(tokens).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


def _mla_variant():
    """DeepSeek-V3 whose MLA shapes differ from the family config: q_proj without a q LoRA, value heads
    wider than q.k heads (the cache pads them), yarn rope whose mscale changes the softmax scale, rotary
    pairs not interleaved."""
    cfg = transformers.DeepseekV3Config(**{
        **DEEPSEEK_V3, "q_lora_rank": None, "v_head_dim": 24, "rope_interleave": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 32}})
    model = build("deepseek_v3", seed=3, config=cfg)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj is not None and attn.scaling != (8 + 8) ** -0.5  # the shapes this variant is for
    return model


@pytest.mark.parametrize("variant", ["family", "plain-q-padded-v-yarn"])
def test_engine_mla_logits_and_tokens_equal_transformers(variant):
    """DeepSeek's multi-head latent attention in the engine (latents expanded per head into the paged
    cache): logits at every prompt position match transformers' forward, and greedy tokens match
    its generate, for the family config (q LoRA, interleaved rotary pairs) and the variant."""
    from quantkit.engine import LLMEngine

    model = build("deepseek_v3") if variant == "family" else _mla_variant()
    assert model.config.rope_interleave == (variant == "family")
    x = ids(2, 21, seed=31)
    with torch.no_grad():
        want = model(x).logits
    got = LLMEngine(model, block_size=4, num_kv_blocks=64, max_num_seqs=2).prompt_logits(x)
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)
    prompts_ = [ids(1, n, seed=20 + n)[0].tolist() for n in (6, 17, 11)]
    assert _engine_tokens(model, prompts_, 16) == _hf_tokens(model, prompts_, 16)
