"""A .gguf file as a quantization source: a plain float transformers model and its tokenizer.

Llama files (every type quantkit writes, and llama.cpp's) go through quantkit's own strict reader and
packers (`container`, `file_io`), bit for bit; other architectures through transformers' GGUF loader.
Config and tokenizer come from the file's metadata (transformers). Every decoded tensor is checked finite.
"""
from __future__ import annotations

from pathlib import Path

import torch

from quantkit.errors import QuantkitError
from quantkit.finite import require_finite
from quantkit.formats.gguf.container import read_gguf
from quantkit.formats.gguf.file_io import read_llama_tensors
from quantkit.qtensor import QuantizedWeight


def load_gguf_model(path: Path, dtype):
    """GGUF -> a plain float model. Llama files (every type quantkit writes, and llama.cpp's) go
    through quantkit's own strict reader and packers, bit for bit; other architectures through
    transformers' GGUF loader. Config and tokenizer come from the file's metadata (transformers)."""
    if not path.is_file():
        raise QuantkitError(f"GGUF file {path} does not exist")
    f = read_gguf(path)  # validates the whole header before anything else reads the file
    arch = f.metadata.get("general.architecture")
    f.close()
    plain = _load_llama_gguf(path) if arch == "llama" else _load_gguf_transformers(path)
    tokenizer = load_gguf_tokenizer(path)
    plain.config.source_dtype = "bfloat16"
    if dtype is not None:
        plain.to(dtype)
    plain.eval()
    return plain, tokenizer, path.stem


def load_gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 - untrusted metadata makes the tokenizer builder raise anything
        raise QuantkitError(f"could not build a tokenizer from GGUF file {path}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _load_llama_gguf(path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM


    f, tensors = read_llama_tensors(path)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        config.tie_word_embeddings = "output.weight" not in f.tensors
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - a config built from hostile metadata can fail anywhere
        raise QuantkitError(f"could not build a model from GGUF file {path}: {_first_line(exc)}") from None
    finally:
        f.close()
    state = {k: (v.dequantize() if isinstance(v, QuantizedWeight) else v.float()) for k, v in tensors.items()}
    for name, value in state.items():
        require_finite(name, value, f"GGUF file {path}")
    expected = model.state_dict()
    for name, value in state.items():
        if name not in expected or tuple(expected[name].shape) != tuple(value.shape):
            want = list(expected[name].shape) if name in expected else "no such tensor"
            raise QuantkitError(f"GGUF file {path}: tensor {name} has shape {list(value.shape)}, the model needs {want}")
    missing = [k for k in expected if k not in state and not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing:
        raise QuantkitError(f"GGUF file {path} lacks {missing[0]} (and {len(missing) - 1} more)")
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def _load_gguf_transformers(path: Path):
    from transformers import AutoModelForCausalLM

    try:
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, gguf_file=path.name)
    except (OSError, ValueError, RuntimeError) as exc:
        raise QuantkitError(f"could not read GGUF file {path}: {str(exc).splitlines()[0]}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=False)
    plain.tie_weights()
    return plain
