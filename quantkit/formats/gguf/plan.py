"""Which GGUF tensor each Llama weight becomes, and in which ggml type: llama-quantize's choices.

The names follow llama.cpp's converter (conversion/llama.py, gguf-py's tensor map); the types
follow src/llama-quant.cpp: `llama_tensor_get_type_impl` for the mixes (Q4_K_M/Q5_K_M give attn_v
and ffn_down Q6_K on the layers where `use_more_bits`; the output matrix, or a tied token
embedding, gets Q6_K, or Q8_0 when its rows are not a multiple of the mix's block) and
`tensor_type_fallback` for rows a block does not divide (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0,
then F16). Norms and other 1-D tensors stay F32, as in every llama.cpp file. A calibrated run
(GPTQ) gets the choices llama-quantize makes with an importance matrix: Q4_0/Q5_0 files put the
first eighth of the layers' ffn_down in Q4_1/Q5_1 (its guard against unstable early ffn_down).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from quantkit.errors import QuantkitError
from quantkit.formats.gguf.types import MIXES, TYPES, GGMLType, fallback

LLAMA_LAYER = {  # HF suffix inside model.layers.N -> llama.cpp name inside blk.N
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
LLAMA_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama"}  # HF model_type -> llama.cpp architecture


@dataclass(frozen=True)
class PlannedTensor:
    hf_name: str
    gguf_name: str
    shape: tuple[int, ...]  # torch order ([out, in] for matrices)
    type: GGMLType
    permute_heads: Optional[int] = None  # attn_q/attn_k: rows reordered for llama.cpp's rope


def gguf_architecture(config) -> str:
    model_type = getattr(config, "model_type", None)
    if model_type not in GGUF_ARCHITECTURES:
        raise QuantkitError(f"GGUF export supports the Llama family ({', '.join(GGUF_ARCHITECTURES)}); "
                            f"this model is {model_type!r}")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise QuantkitError("GGUF export of Llama models with attention or MLP biases is not supported")
    if getattr(config, "sliding_window", None):
        raise QuantkitError("GGUF export of sliding-window attention (Mistral v0.1) is not supported")
    return GGUF_ARCHITECTURES[model_type]


def gguf_name(hf_name: str) -> Optional[str]:
    if hf_name in LLAMA_TOP:
        return LLAMA_TOP[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if m and m.group(2) in LLAMA_LAYER:
        return f"blk.{m.group(1)}.{LLAMA_LAYER[m.group(2)]}"
    return None


def hf_name_of(gguf_tensor: str) -> Optional[str]:
    for hf, g in LLAMA_TOP.items():
        if g == gguf_tensor:
            return hf
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_tensor)
    if m:
        for hf, g in LLAMA_LAYER.items():
            if g == m.group(2):
                return f"model.layers.{m.group(1)}.{hf}"
    return None


IMATRIX_EARLY_FFN_DOWN = {"Q4_0": "Q4_1", "Q5_0": "Q5_1"}  # llama-quant.cpp, has_imatrix && i_layer < n_layer/8


def use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp: the first and last eighth of the layers and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(gguf_tensor: str, shape: tuple[int, ...], gguf_type: str, n_layers: int, tied: bool,
                calibrated: bool = False) -> GGMLType:
    """The ggml type llama-quantize gives `gguf_tensor` (torch shape) for file type `gguf_type`
    (`calibrated`: as it does when given an importance matrix)."""
    default = TYPES[MIXES.get(gguf_type, gguf_type)]
    if len(shape) < 2 or gguf_tensor.endswith("_norm.weight"):
        return TYPES["F32"]
    if not default.quantized:
        return default
    cols = shape[-1]
    layer = re.match(r"blk\.(\d+)\.", gguf_tensor)
    i = int(layer.group(1)) if layer else -1
    chosen = default
    if gguf_tensor == "output.weight" or (tied and gguf_tensor == "token_embd.weight"):
        chosen = TYPES["Q8_0"] if cols % default.block else (default if default.name == "Q8_0" else TYPES["Q6_K"])
    elif gguf_type in MIXES and gguf_tensor.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(i, n_layers):
        chosen = TYPES["Q6_K"]
    elif (calibrated and gguf_type in IMATRIX_EARLY_FFN_DOWN and gguf_tensor.endswith("ffn_down.weight")
          and i < n_layers // 8):
        chosen = TYPES[IMATRIX_EARLY_FFN_DOWN[gguf_type]]
    return fallback(chosen, cols)


def plan_model(state_shapes: dict[str, tuple[int, ...]], config, gguf_type: str,
               calibrated: bool = False) -> list[PlannedTensor]:
    """Every tensor of the GGUF file in llama.cpp's order (token_embd, blocks, output_norm, output);
    `calibrated`: the types llama-quantize picks when it has an importance matrix."""
    gguf_architecture(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    n_layers = int(config.num_hidden_layers)
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    out = []
    for hf, shape in state_shapes.items():
        if tied and hf == "lm_head.weight":
            continue  # llama.cpp reuses token_embd (no output.weight in the file)
        name = gguf_name(hf)
        if name is None:
            if hf.endswith("rotary_emb.inv_freq"):
                continue
            raise QuantkitError(f"GGUF export does not know where the tensor {hf} goes; it supports plain Llama models")
        permute = heads if name.endswith("attn_q.weight") else kv_heads if name.endswith("attn_k.weight") else None
        ggml = tensor_type(name, shape, gguf_type, n_layers, tied, calibrated)
        out.append(PlannedTensor(hf, name, tuple(shape), ggml, permute))
    order = {"token_embd.weight": (-1, 0), "output_norm.weight": (n_layers, 0), "output.weight": (n_layers, 1)}
    layer_order = list(LLAMA_LAYER.values())

    def key(p: PlannedTensor):
        if p.gguf_name in order:
            return order[p.gguf_name]
        i, rest = p.gguf_name.split(".", 2)[1:]
        return (int(i), 1 + layer_order.index(rest))

    return sorted(out, key=key)
