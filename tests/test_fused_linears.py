"""Linears vLLM fuses (q/k/v -> qkv_proj, gate/up -> gate_up_proj) must share one scheme, and gptq's
`dynamic` rules must name them the way vLLM looks them up (quantkit.formats.fused_linears).

vLLM matches a rule with re.match against the *fused* layer's name (vllm/model_executor/layers/
quantization/utils/gptq_utils.py get_dynamic_override); GPTQModel and quantkit against the
checkpoint's own names. `vllm_rule_for` below is vLLM's function restated, the oracle for the first.
The vLLM tier (tests/test_vllm.py, gptq-mixture) loads such a checkpoint in vLLM itself.
"""
from __future__ import annotations

import re

from quantkit.allocation import mixture
from quantkit.formats import gptq
from quantkit.formats.fused_linears import fused_groups
from quantkit.formats.loaders import vllm_refusal
from quantkit.formats.spec import LinearSpec

ATTN, MLP = "model.layers.0.self_attn", "model.layers.0.mlp"


def _spec(group_size: int, bits: int = 4) -> LinearSpec:
    return LinearSpec(out_features=64, in_features=64, bits=bits, group_size=group_size, sym=True, act_order="none")


def vllm_rule_for(dynamic: dict, layer_name: str):
    """vLLM 0.32's get_dynamic_override(config, layer_name) without a key: False, a dict, or None."""
    for pattern, overrides in dynamic.items():
        if pattern.startswith("-:"):
            if re.match(pattern.removeprefix("-:"), layer_name):
                return False
        elif re.match(pattern.removeprefix("+:"), layer_name):
            return overrides
    return None


def _layer(qkv: int, gate_up: int, o: int = 64, down: int = 64) -> dict[str, LinearSpec]:
    return {f"{ATTN}.q_proj": _spec(qkv), f"{ATTN}.k_proj": _spec(qkv), f"{ATTN}.v_proj": _spec(qkv),
            f"{ATTN}.o_proj": _spec(o), f"{MLP}.gate_proj": _spec(gate_up), f"{MLP}.up_proj": _spec(gate_up),
            f"{MLP}.down_proj": _spec(down)}


def test_fused_groups_are_complete_siblings_only():
    names = [f"{ATTN}.q_proj", f"{ATTN}.k_proj", f"{ATTN}.v_proj", f"{MLP}.gate_proj", "model.layers.1.mlp.gate_proj",
             "model.layers.1.mlp.up_proj"]
    assert fused_groups(names) == {f"{ATTN}.qkv_proj": names[:3],
                                   "model.layers.1.mlp.gate_up_proj": names[4:]}  # layer 0's up_proj missing


def test_gptq_rules_reach_vllm_fused_names_and_read_back():
    specs = {**_layer(qkv=32, gate_up=-1, down=128),
             **{n.replace("layers.0", "layers.1"): s for n, s in _layer(qkv=64, gate_up=64).items()}}
    ignored = ["model.layers.2.mlp.gate_proj", "model.layers.2.mlp.up_proj"]
    qcfg = gptq.quantization_config(specs, ignored, {})
    assert qcfg["group_size"] == 64
    dyn = qcfg["dynamic"]
    assert vllm_rule_for(dyn, f"{ATTN}.qkv_proj")["group_size"] == 32
    assert vllm_rule_for(dyn, f"{MLP}.gate_up_proj")["group_size"] == -1
    assert vllm_rule_for(dyn, f"{MLP}.down_proj")["group_size"] == 128
    assert vllm_rule_for(dyn, "model.layers.1.self_attn.qkv_proj") is None  # base scheme: no rule
    assert vllm_rule_for(dyn, "model.layers.2.mlp.gate_up_proj") is False
    assert vllm_rule_for(dyn, "model.layers.0.self_attn.qkv_projection") is None  # anchored
    # quantkit (and GPTQModel, same matching) read every linear back at its own scheme
    shapes = {n: (64, 64) for n in [*specs, *ignored]}
    back = gptq.parse_quantization_config(qcfg, list(shapes), shapes)
    assert back == specs
    assert vllm_refusal("gptq", specs) is None


def test_a_fused_group_split_across_schemes_is_refused_for_vllm():
    specs = _layer(qkv=32, gate_up=64)
    specs[f"{ATTN}.k_proj"] = _spec(64)
    why = vllm_refusal("gptq", specs)
    assert why is not None and "qkv_proj" in why and '"AssertionError"' in why
    assert vllm_refusal("gptq", list(specs.values())) is None  # without names nothing can be said
    # written per module, as before: quantkit still reads it
    qcfg = gptq.quantization_config(specs, [], {})
    shapes = {n: (64, 64) for n in specs}
    assert gptq.parse_quantization_config(qcfg, list(shapes), shapes) == specs


def _row(linear: str, scheme: str, nbytes: int, kl: float) -> dict:
    bits = int(scheme[1])
    return {"linear": linear, "scheme": scheme, "bits": bits, "group_size": 32, "sym": True, "bytes": nbytes,
            "weights": 64 * 64, "predicted_kl": kl}


def test_allocation_gives_a_fused_group_one_scheme():
    # Unconstrained, the budget buys 8 bits for q_proj alone (the one sensitive member), which vLLM cannot
    # serve; as one item q/k/v move together, so the best affordable choice is a uniform group.
    rows = []
    for leaf, kl8, kl4 in (("q_proj", 0.0, 10.0), ("k_proj", 0.0, 0.1), ("v_proj", 0.0, 0.1)):
        rows += [_row(f"{ATTN}.{leaf}", "w4g32", 100, kl4), _row(f"{ATTN}.{leaf}", "w8g32", 200, kl8)]
    rows += [_row(f"{ATTN}.o_proj", "w4g32", 100, 1.0), _row(f"{ATTN}.o_proj", "w8g32", 200, 0.0)]
    choice = mixture.allocate(rows, budget_bytes=500)
    assert {choice[f"{ATTN}.{leaf}"]["scheme"] for leaf in ("q_proj", "k_proj", "v_proj")} == {"w4g32"}
    assert choice[f"{ATTN}.o_proj"]["scheme"] == "w8g32"
    choice = mixture.allocate(rows, budget_bytes=700)  # room for the whole group at 8 bits
    assert {choice[f"{ATTN}.{leaf}"]["scheme"] for leaf in ("q_proj", "k_proj", "v_proj")} == {"w8g32"}
    assert sum(r["bytes"] for r in choice.values()) <= 700


def test_a_fused_group_partly_ignored_is_refused_for_vllm_but_a_lone_q_proj_is_not():
    specs = _layer(qkv=64, gate_up=64)
    del specs[f"{ATTN}.v_proj"]  # v_proj ignored: vLLM's qkv_proj would be half quantized
    assert "only some" in vllm_refusal("gptq", specs)
    lone = {f"{ATTN}.q_proj": _spec(64), f"{ATTN}.o_proj": _spec(64)}  # MLA-like: q_proj with no k/v siblings
    assert vllm_refusal("gptq", lone) is None
