"""Architecture adapters on tiny random models of every supported family.

The adapters encode module names by hand, so each test checks them against what the model
actually runs (forward hooks), and folding is checked where it matters: logits are unchanged.
"""
import pytest
import torch
import torch.nn as nn
import transformers
from transformers import AutoModelForCausalLM

from conftest import perturb_norms
from quantkit.errors import QuantkitError
from quantkit.models import SUPPORTED_MODEL_TYPES, InputGroup, fold_scales, get_adapter

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128, max_position_embeddings=64)
LLAMA_LIKE = dict(COMMON, intermediate_size=128)

# name -> config factory. Variants cover GQA vs MHA (v->o in or out), biases, head_dim != hidden/heads,
# and OPT's post-LN / project_in+out / non-ReLU layout.
CONFIGS = {
    "llama_gqa": lambda: transformers.LlamaConfig(**LLAMA_LIKE, num_key_value_heads=2),
    "llama_mha_bias": lambda: transformers.LlamaConfig(
        **LLAMA_LIKE, num_key_value_heads=4, attention_bias=True, mlp_bias=True
    ),
    "mistral": lambda: transformers.MistralConfig(**LLAMA_LIKE, num_key_value_heads=2),
    "qwen2": lambda: transformers.Qwen2Config(**LLAMA_LIKE, num_key_value_heads=4),  # q/k/v biases
    "qwen3": lambda: transformers.Qwen3Config(**LLAMA_LIKE, num_key_value_heads=4, head_dim=32),
    "phi3_gqa": lambda: transformers.Phi3Config(**LLAMA_LIKE, num_key_value_heads=2, pad_token_id=0),
    "phi3_mha": lambda: transformers.Phi3Config(**LLAMA_LIKE, num_key_value_heads=4, pad_token_id=0),
    "opt": lambda: transformers.OPTConfig(**COMMON, ffn_dim=128, word_embed_proj_dim=64),
    "opt_postln_proj_gelu": lambda: transformers.OPTConfig(
        **COMMON, ffn_dim=128, word_embed_proj_dim=32, do_layer_norm_before=False, activation_function="gelu"
    ),
}

# Which input groups each variant must get: (prev, linears) pairs.
EXPECTED_GROUPS = {
    "llama_gqa": [("input_layernorm", 3), ("self_attn.v_proj", 1), ("post_attention_layernorm", 2),
                  ("mlp.up_proj", 1)],
    "llama_mha_bias": [("input_layernorm", 3), ("self_attn.v_proj", 1), ("post_attention_layernorm", 2),
                       ("mlp.up_proj", 1)],
    "mistral": [("input_layernorm", 3), ("self_attn.v_proj", 1), ("post_attention_layernorm", 2), ("mlp.up_proj", 1)],
    "qwen2": [("input_layernorm", 3), ("self_attn.v_proj", 1), ("post_attention_layernorm", 2), ("mlp.up_proj", 1)],
    "qwen3": [("input_layernorm", 3), ("self_attn.v_proj", 1), ("post_attention_layernorm", 2), ("mlp.up_proj", 1)],
    "phi3_gqa": [("input_layernorm", 1), ("self_attn.qkv_proj", 1), ("post_attention_layernorm", 1),
                 ("mlp.gate_up_proj", 1)],
    "phi3_mha": [("input_layernorm", 1), ("self_attn.qkv_proj", 1), ("post_attention_layernorm", 1),
                 ("mlp.gate_up_proj", 1)],
    "opt": [("self_attn_layer_norm", 3), ("self_attn.v_proj", 1), ("final_layer_norm", 1), ("fc1", 1)],
    "opt_postln_proj_gelu": [("self_attn.v_proj", 1)],
}


def build(name, attn="eager"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation=attn, dtype=torch.float32)
    model.eval()
    perturb_norms(model)
    return model


def tokens():
    return torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def logits(model):
    with torch.no_grad():
        return model(input_ids=tokens()).logits


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def random_scales(n, gen):
    return torch.exp(torch.randn(n, generator=gen) * 0.5)


def layer_out(output):
    return output[0] if isinstance(output, tuple) else output


@pytest.mark.parametrize("name", list(CONFIGS))
def test_structure_matches_what_runs(name):
    model = build(name)
    adapter = get_adapter(model)
    assert model.config.model_type in adapter.model_types
    layers = adapter.decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    prefix = adapter.layers_prefix(model)
    assert model.get_submodule(prefix) is layers
    assert adapter.layer_name(model, 1, "fc1") == f"{prefix}.1.fc1"

    embeds = adapter.embeddings(model)
    post = adapter.post_layers(model)
    head_name, head = adapter.lm_head(model)
    for full_name, mod in embeds + post + [(head_name, head)]:
        assert model.get_submodule(full_name) is mod
    norm = adapter.final_norm(model)
    if name == "opt_postln_proj_gelu":
        assert norm is None and [n for n, _ in post] == ["model.decoder.project_out"]
        assert [n for n, _ in embeds][-1] == "model.decoder.project_in"
    else:
        assert post[0] == norm and model.get_submodule(norm[0]) is norm[1]
    rot = adapter.rotary_embedding(model)
    assert (rot is None) == (model.config.model_type == "opt")
    if rot is not None:
        assert any(m is rot for _, m in embeds)

    # Record the order modules finish in; watch the ones the adapter names.
    watched = {id(m): n for n, m in embeds + post + [(head_name, head)]}
    watched.update({id(layer): f"{prefix}.{i}" for i, layer in enumerate(layers)})
    lin0 = {id(layers[0].get_submodule(n)): n for n in adapter.linear_names(layers[0])}
    order, lin_order, captured = [], [], {}

    def hook(mod, args, output):
        if id(mod) in watched:
            order.append(watched[id(mod)])
        if id(mod) in lin0:
            lin_order.append(lin0[id(mod)])
        if mod is layers[-1]:
            captured["last"] = layer_out(output)

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        out = logits(model)
    finally:
        for h in handles:
            h.remove()
    expected = [n for n, _ in embeds] + [f"{prefix}.{i}" for i in range(len(layers))]
    expected += [n for n, _ in post] + [head_name]
    assert order == expected
    assert lin_order == adapter.linear_names(layers[0])  # execution order

    # The head path the adapter describes really produces the logits.
    with torch.no_grad():
        h = captured["last"]
        for _, mod in post:
            h = mod(h)
        assert rel_err(head(h), out) < 1e-6

    for layer in layers:
        names = adapter.linear_names(layer)
        all_linears = [n for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
        assert sorted(names) == sorted(all_linears) and len(set(names)) == len(names)
        staged = [n for stage in adapter.sequential_stages(layer) for n in stage]
        assert sorted(staged) == sorted(names) and len(set(staged)) == len(staged)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_input_groups_reference_real_inputs(name):
    model = build(name)
    adapter = get_adapter(model.config)
    layer = adapter.decoder_layers(model)[0]
    groups = adapter.input_groups(layer, model.config)
    assert [(g.prev, len(g.linears)) for g in groups] == EXPECTED_GROUPS[name]
    names = adapter.linear_names(layer)
    seen = {}

    def capture(key):
        def hook(mod, args, output):
            seen.setdefault(key, (args[0].detach(), layer_out(output).detach()))
        return hook

    handles = []
    for g in groups:
        prev = layer.get_submodule(g.prev)
        linears = [layer.get_submodule(n) for n in g.linears]
        assert all(n in names for n in g.linears)
        assert len({lin.in_features for lin in linears}) == 1
        inspect = layer.get_submodule(g.inspect)
        assert all(any(lin is m for m in inspect.modules()) for lin in linears)
        if g.kind == "norm":
            assert not isinstance(prev, nn.Linear) and prev.weight.shape == (linears[0].in_features,)
        else:
            assert g.prev in names
            start, stop = g.prev_rows or (0, prev.out_features)
            n_rep = g.kv_heads[1] if g.kv_heads else 1  # GQA: one prev row feeds n_rep input channels
            assert (stop - start) * n_rep == linears[0].in_features and stop <= prev.out_features
        handles.append(prev.register_forward_hook(capture(g.prev)))
        handles += [layer.get_submodule(n).register_forward_hook(capture(n)) for n in g.linears]
    try:
        logits(model)
    finally:
        for h in handles:
            h.remove()
    # A norm group's prev output is exactly what its linears consume.
    for g in groups:
        if g.kind == "norm":
            for n in g.linears:
                assert torch.equal(seen[n][0].reshape(-1), seen[g.prev][1].reshape(-1))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_folding_every_group_keeps_logits(name, attn):
    model = build(name, attn)
    ref = logits(model)
    adapter = get_adapter(model)
    first = adapter.decoder_layers(model)[0]
    watched = first.get_submodule(adapter.input_groups(first)[0].linears[0]).weight
    before = watched.clone()
    gen = torch.Generator().manual_seed(2)
    n_groups = 0
    for layer in adapter.decoder_layers(model):
        for g in adapter.input_groups(layer, model.config):
            n = layer.get_submodule(g.linears[0]).in_features
            fold_scales(layer, g, g.tie(random_scales(n, gen)))
            n_groups += 1
    assert n_groups == 2 * len(EXPECTED_GROUPS[name])
    assert not torch.equal(watched, before)  # folding really changed the weights
    out = logits(model)
    assert rel_err(out, ref) < 1e-4, rel_err(out, ref)


def _fold_and_compare(name, layer_fn):
    model = build(name)
    ref = logits(model)
    layer_fn(get_adapter(model).decoder_layers(model)[0])
    return rel_err(logits(model), ref)


def test_excluded_mappings_are_really_unsafe():
    gen = torch.Generator().manual_seed(3)

    # OPT with GELU: fc1 -> fc2 does not commute with the activation.
    def fold_fc1(layer):
        fold_scales(layer, InputGroup("fc1", ("fc2",), "fc2", "linear"), random_scales(128, gen))
    assert _fold_and_compare("opt_postln_proj_gelu", fold_fc1) > 1e-3

    # Post-LN OPT: self_attn_layer_norm normalises the residual stream, not q/k/v's input.
    def fold_norm(layer):
        g = InputGroup("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                       "self_attn", "norm")
        fold_scales(layer, g, random_scales(64, gen))
    assert _fold_and_compare("opt_postln_proj_gelu", fold_norm) > 1e-3

    # Phi-3 with GQA: AutoAWQ's "last o_proj.in_features rows of qkv_proj" includes k rows.
    def fold_autoawq_style(layer):
        qkv, o = layer.self_attn.qkv_proj, layer.self_attn.o_proj
        g = InputGroup("self_attn.qkv_proj", ("self_attn.o_proj",), "self_attn.o_proj", "linear",
                       prev_rows=(qkv.out_features - o.in_features, qkv.out_features))
        fold_scales(layer, g, random_scales(o.in_features, gen))
    assert _fold_and_compare("phi3_gqa", fold_autoawq_style) > 1e-3

    # Llama with GQA: v has fewer channels than o's input, fold_scales refuses.
    model = build("llama_gqa")
    layer = get_adapter(model).decoder_layers(model)[0]
    with pytest.raises(ValueError):
        fold_scales(layer, InputGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj", "linear"),
                    random_scales(64, gen))


def test_fold_scales_rejects_bad_scales():
    model = build("llama_gqa")
    adapter = get_adapter(model)
    layer = adapter.decoder_layers(model)[0]
    g = adapter.input_groups(layer)[0]
    for bad in (torch.zeros(64), -torch.ones(64), torch.full((64,), float("nan")), torch.ones(32)):
        with pytest.raises(ValueError):
            fold_scales(layer, g, bad)


def test_fold_scales_bf16_rounds_once():
    model = build("llama_gqa").to(torch.bfloat16)
    layer = get_adapter(model).decoder_layers(model)[0]
    g = get_adapter(model).input_groups(layer)[0]
    before = layer.input_layernorm.weight.float().clone()
    s = random_scales(64, torch.Generator().manual_seed(4))
    fold_scales(layer, g, s)
    assert layer.input_layernorm.weight.dtype == torch.bfloat16
    assert torch.equal(layer.input_layernorm.weight, (before / s).to(torch.bfloat16))


def test_get_adapter_accepts_model_config_and_string():
    model = build("phi3_mha")
    assert get_adapter(model) is get_adapter(model.config) is get_adapter("phi3")
    assert get_adapter("qwen3") is get_adapter("llama")
    assert tuple(sorted(SUPPORTED_MODEL_TYPES)) == SUPPORTED_MODEL_TYPES
    for t in SUPPORTED_MODEL_TYPES:
        assert t in get_adapter(t).model_types


def test_unknown_architecture_lists_supported():
    with pytest.raises(QuantkitError) as exc:
        get_adapter(transformers.GPT2Config())
    msg = str(exc.value)
    assert msg == ("unsupported architecture 'gpt2'; supported: deepseek_v3, llama, mistral, mixtral, olmoe, opt, phi3, "
                   "qwen2, qwen2_moe, qwen3, qwen3_moe")
    with pytest.raises(QuantkitError, match="supported: deepseek_v3, llama"):
        get_adapter(object())


def test_base_model_and_unknown_linear_are_clear_errors():
    model = build("llama_gqa")
    adapter = get_adapter(model)
    with pytest.raises(QuantkitError, match="no module 'model.layers'") as exc:
        adapter.decoder_layers(model.model)  # AutoModel, not the causal LM
    assert "\n" not in str(exc.value)
    layer = adapter.decoder_layers(model)[0]
    layer.mlp.extra_proj = nn.Linear(64, 64)
    with pytest.raises(QuantkitError, match="mlp.extra_proj"):
        adapter.linear_names(layer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,width", [(1, 576), (13, 64)])
def test_shared_rms_norm_equals_transformers_llama_rmsnorm(dtype, rows, width):
    """quantkit.models.norms.rms_norm (the one fused RMSNorm for driver and engine) against the module itself."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from quantkit.models.norms import rms_norm

    gen = torch.Generator().manual_seed(rows)
    module = LlamaRMSNorm(width, eps=1e-6)
    module.weight.data = torch.randn(width, generator=gen).to(dtype)
    x = (3 * torch.randn(2, rows, width, generator=gen)).to(dtype)
    with torch.no_grad():
        expected = module(x)
    assert torch.equal(rms_norm(x, module.weight.data, 1e-6), expected)
    buffer = torch.full((2, rows + 1, width), float("nan"), dtype=expected.dtype)
    rms_norm(x, module.weight.data, 1e-6, out=buffer[:, 1:])
    assert torch.equal(buffer[:, 1:], expected)
