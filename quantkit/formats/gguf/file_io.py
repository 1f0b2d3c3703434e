"""GGUF files for llama.cpp: the writer and quantkit's own reader, both through gguf_blocks.

Writing follows llama.cpp's converter (conversion/llama.py, base.py): Llama hyper-parameters under
`llama.*`, the byte-level BPE tokenizer as `tokenizer.ggml.*` (tokens, token types, merges,
special ids, the pre-tokenizer name found by the converter's hash of a probe text, the chat
template), attn_q/attn_k rows permuted for llama.cpp's rope, no output.weight when the
embeddings are tied (llama.cpp reuses token_embd). Every tensor is packed by gguf_blocks, which
refuses a weight its type cannot hold exactly. Reading parses with gguf_file (strict, bounded),
unpacks with the same packers and undoes the permutation, so a written file reads back bit for bit.
"""
from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

import numpy as np
import torch

from quantkit.errors import QuantkitError
from quantkit.formats.gguf import blocks as gguf_blocks
from quantkit.formats.gguf.container import GGUFFile, read_gguf
from quantkit.formats.gguf.types import FILE_TYPES, TYPES
from quantkit.formats.gguf.plan import PlannedTensor, gguf_architecture, hf_name_of
from quantkit.qtensor import QuantizedWeight

NAME = "gguf"
FILENAME = "model.gguf"

# the converter's probe text (conversion/base.py get_vocab_base_pre) and the hashes of its token
# ids for the byte-level BPE pre-tokenizers of the Llama family's common vocabularies
PRE_TOKENIZER_PROBE = '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, \'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL'
PRE_TOKENIZERS = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4": "gpt-2",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",
}
TOKEN_NORMAL, TOKEN_UNUSED, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 5, 3, 4

Producer = Callable[[], Union[QuantizedWeight, torch.Tensor]]


def permutation(rows: int, heads: int) -> torch.Tensor:
    """Row order llama.cpp wants for attn_q/attn_k (conversion/llama.py `permute`): within each
    head, the rope pairs (i, i + d/2) of HF's rotate_half layout become adjacent rows."""
    idx = torch.arange(rows)
    return idx.reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)


def _rows(x, index: torch.Tensor):
    return x.select_rows(index) if isinstance(x, QuantizedWeight) else x[index]


# ------------------------------------------------------------------ writing

def write_gguf(path: Path, config, tokenizer, gguf_type: str, tensors: Iterable[tuple[PlannedTensor, Producer]],
               name: str) -> None:
    """Write `path` with llama's metadata, the tokenizer and each planned tensor (packed as planned)."""
    import gguf

    arch = gguf_architecture(config)
    entries = list(tensors)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name(name)
    w.add_file_type(FILE_TYPES[gguf_type])
    if any(p.type.quantized for p, _ in entries):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_hparams(w, config)
    add_tokenizer(w, tokenizer, int(config.vocab_size))
    for p, _ in entries:
        w.add_tensor_info(p.gguf_name, _byte_shape(p), np.dtype(np.uint8), _nbytes(p), raw_dtype=gguf.GGMLQuantizationType(p.type.id))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for p, produce in entries:
        w.write_tensor_data(pack_tensor(p, produce()))
    w.close()


def _byte_shape(p: PlannedTensor) -> tuple[int, ...]:
    return (*p.shape[:-1], p.type.row_bytes(p.shape[-1]))


def _nbytes(p: PlannedTensor) -> int:
    return int(np.prod(_byte_shape(p)))


def pack_tensor(p: PlannedTensor, value) -> np.ndarray:
    """One tensor's bytes in its planned type (rows permuted for attn_q/attn_k)."""
    if p.permute_heads:
        value = _rows(value, permutation(p.shape[0], p.permute_heads))
    try:
        if isinstance(value, QuantizedWeight):
            raw = gguf_blocks.pack(value, p.type)
        elif p.type.quantized:
            raise QuantkitError(f"{p.type.name} needs a quantized weight, got floats")
        else:
            raw = gguf_blocks.pack_float(value, p.type)
    except QuantkitError as err:
        raise QuantkitError(f"{p.hf_name} -> {p.gguf_name}: {err}") from None
    if tuple(raw.shape) != _byte_shape(p):
        raise QuantkitError(f"internal: {p.gguf_name} packed to {list(raw.shape)}, planned {list(_byte_shape(p))}")
    return np.ascontiguousarray(raw)


def _add_hparams(w, config) -> None:
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if rope.get("rope_type", "default") not in ("default", None):
        raise QuantkitError(f"GGUF export does not support rope scaling {rope.get('rope_type')!r} yet")
    w.add_vocab_size(int(config.vocab_size))
    w.add_context_length(int(config.max_position_embeddings))
    w.add_embedding_length(int(config.hidden_size))
    w.add_block_count(int(config.num_hidden_layers))
    w.add_feed_forward_length(int(config.intermediate_size))
    w.add_head_count(heads)
    w.add_head_count_kv(int(config.num_key_value_heads))
    w.add_rope_dimension_count(int(head_dim))
    if head_dim != config.hidden_size // heads:
        w.add_key_length(int(head_dim))
        w.add_value_length(int(head_dim))
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))


def add_tokenizer(w, tokenizer, vocab_size: int) -> None:
    """tokenizer.ggml.* as the converter's _set_vocab_gpt2 writes them (byte-level BPE only)."""
    import gguf

    if tokenizer is None:
        raise QuantkitError("GGUF export needs the model's tokenizer (llama.cpp tokenizes from the file)")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    if (spec.get("model") or {}).get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise QuantkitError("GGUF export supports byte-level BPE tokenizers (Llama 3, SmolLM, Qwen style); "
                            "this model's tokenizer is not one")
    tokens, types = _vocab(tokenizer, vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre_tokenizer_name(tokenizer))
    w.add_token_list(tokens)
    w.add_token_types(types)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        logging.getLogger("gguf.vocab").setLevel(logging.ERROR)
        gguf.SpecialVocab(tmp, load_merges=True).add_to_gguf(w, quiet=True)
    if vocab_size == 49152:  # the converter's rule for this vocabulary (SmolLM, granite small)
        w.add_add_bos_token(False)


def _vocab(tokenizer, vocab_size: int):
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise QuantkitError(f"the tokenizer has ids up to {max(vocab.values())} but the model only {vocab_size} embeddings")
    reverse = {i: tok for tok, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        tok = reverse.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
        elif tok in added:
            special = decoder[i].special if i in decoder else False
            tokens.append(tok)
            types.append(TOKEN_CONTROL if special else TOKEN_USER_DEFINED)
        else:
            tokens.append(tok)
            types.append(TOKEN_NORMAL)
    return tokens, types


def pre_tokenizer_name(tokenizer) -> str:
    """llama.cpp's name for this BPE pre-tokenizer, found as the converter does (hash of the probe's ids)."""
    ids = tokenizer.encode(PRE_TOKENIZER_PROBE)
    digest = hashlib.sha256(str(ids).encode()).hexdigest()
    if digest not in PRE_TOKENIZERS:
        raise QuantkitError(f"llama.cpp has no pre-tokenizer known to quantkit for this tokenizer (hash {digest[:12]}); "
                            f"quantkit knows {', '.join(sorted(set(PRE_TOKENIZERS.values())))}")
    return PRE_TOKENIZERS[digest]


# ------------------------------------------------------------------ reading

def read_tensor(f: GGUFFile, name: str) -> Union[QuantizedWeight, torch.Tensor]:
    """One tensor as stored (GGUF row order): a QuantizedWeight for the quantized types quantkit
    writes, a float tensor for F32/F16/BF16 and for other ggml types (decoded by gguf-py)."""
    ti = f.tensors[name]
    raw = f.raw(name)
    if ti.type.name not in TYPES:
        import gguf

        try:
            values = gguf.quants.dequantize(np.array(raw).reshape(-1), gguf.GGMLQuantizationType(ti.type.id))
        except (NotImplementedError, ValueError) as exc:
            raise QuantkitError(f"GGUF tensor {name!r} has type {ti.type.name}, which cannot be decoded ({exc})") from None
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(ti.torch_shape)
    if ti.type.quantized:
        if len(ti.shape) != 2:
            raise QuantkitError(f"GGUF tensor {name!r} is a {len(ti.shape)}-D quantized tensor; quantkit reads matrices")
        return gguf_blocks.unpack(raw, ti.type, ti.shape[0])
    return gguf_blocks.unpack_float(raw, ti.type, ti.torch_shape)


def read_llama_tensors(path) -> tuple[GGUFFile, dict[str, Union[QuantizedWeight, torch.Tensor]]]:
    """Every tensor of a llama GGUF under its Hugging Face name, attn_q/attn_k rows back in HF order."""
    f = read_gguf(path)
    try:
        arch = f.metadata.get("general.architecture")
        if arch != "llama":
            raise QuantkitError(f"GGUF file {path} holds a {arch!r} model; quantkit reads llama GGUF files itself")
        heads = _meta_int(f, "llama.attention.head_count")
        kv_heads = _meta_int(f, "llama.attention.head_count_kv", heads)
        out = {}
        for name, ti in f.tensors.items():
            hf = hf_name_of(name)
            if hf is None:
                if name == "rope_freqs.weight":
                    continue
                raise QuantkitError(f"GGUF file {path} has a tensor {name!r} that quantkit does not map to the model")
            value = read_tensor(f, name)
            n_heads = heads if name.endswith("attn_q.weight") else kv_heads if name.endswith("attn_k.weight") else None
            if n_heads:
                rows = ti.torch_shape[0]
                if n_heads <= 0 or rows % (2 * n_heads):
                    raise QuantkitError(f"GGUF file {path}: {name} has {rows} rows, not a multiple of 2 x {n_heads} heads")
                value = _rows(value, torch.argsort(permutation(rows, n_heads)))
            out[hf] = value
        return f, out
    except BaseException:
        f.close()
        raise


def _meta_int(f: GGUFFile, key: str, default: Optional[int] = None) -> int:
    v = f.metadata.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise QuantkitError(f"GGUF file {f.path}: metadata {key} is {v!r}, expected a positive integer")
    return v
