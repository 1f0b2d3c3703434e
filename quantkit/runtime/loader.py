"""Load a quantized checkpoint for inference without ever materialising full-precision weights.

The skeleton is built on the meta device (accelerate's `init_empty_weights`), every linear the
checkpoint's `quantization_config` names is swapped for a `QuantLinear` holding the packed
tensors, and the state dict is assigned straight from safetensors. Only safetensors are read:
no pickle, ever.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from quantkit.errors import QuantkitError

QUANT_METHOD_TO_FORMAT = {"gptq": "gptq", "compressed-tensors": "compressed-tensors", "awq": "awq"}


def resolve_checkpoint(path: str) -> Path:
    if path == "demo":
        from quantkit.assets import demo_model_dir

        return Path(demo_model_dir())
    p = Path(path)
    if not p.exists():
        raise QuantkitError(f"model path {path} does not exist; pass a checkpoint folder or 'demo'")
    if not p.is_dir():
        raise QuantkitError(f"{path} is not a folder; pass a checkpoint folder (config.json + *.safetensors)")
    return p


def read_config(folder: Path) -> dict:
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise QuantkitError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QuantkitError(f"{cfg_file} is not valid JSON ({exc}); re-create the checkpoint") from None
    if not isinstance(cfg, dict):
        raise QuantkitError(f"{cfg_file} must hold a JSON object")
    return cfg


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise QuantkitError(f"{index} is not a valid safetensors index; re-create the checkpoint") from None
        files = []
        for name in sorted(set(weight_map.values())):
            f = (folder / name)
            if f.resolve().parent != folder.resolve():
                raise QuantkitError(f"{index} points outside the checkpoint folder ({name})")
            files.append(f)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise QuantkitError(f"{folder} is missing shard(s) {', '.join(missing)} listed in its index")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth")):
        raise QuantkitError(f"{folder} holds only pickle weights (.bin/.pt); quantkit loads safetensors only — convert them first")
    raise QuantkitError(f"{folder} has no model.safetensors or model.safetensors.index.json")


def read_state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise QuantkitError(f"{f} is not a valid safetensors file ({detail}); re-download or re-create it") from None
        dup = state.keys() & tensors.keys()
        if dup:
            raise QuantkitError(f"{f} repeats tensor {sorted(dup)[0]} from another shard")
        state.update(tensors)
    return state


def _clean_config(cfg: dict, folder: Path, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise QuantkitError(f"{folder}/config.json is not a usable model config ({str(exc).splitlines()[0]})") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def load_model(path: str, backend: str = "auto", device: Optional[str] = None, dtype: Optional[str] = None,
               trust_remote_code: bool = False):
    """A transformers causal LM whose quantized linears are `QuantLinear`s on `backend`."""
    from quantkit.sources import parse_dtype

    folder = resolve_checkpoint(path)
    cfg = read_config(folder)
    qcfg = cfg.get("quantization_config")
    files = safetensors_files(folder)
    device = torch.device(device or "cpu")
    if not qcfg:
        return _load_plain(folder, files, parse_dtype(dtype) or default_compute_dtype(None, device), device,
                           trust_remote_code)
    if not isinstance(qcfg, dict):
        raise QuantkitError(f"{folder}/config.json: quantization_config must be an object")
    method = qcfg.get("quant_method")
    if method not in QUANT_METHOD_TO_FORMAT:
        raise QuantkitError(f"{folder}/config.json: unknown quant_method {method!r}; quantkit reads "
                            f"{', '.join(QUANT_METHOD_TO_FORMAT)}")
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from quantkit.formats import get_format
    from quantkit.runtime.quant_linear import QuantLinear

    fmt = get_format(QUANT_METHOD_TO_FORMAT[method])
    config = _clean_config(cfg, folder, trust_remote_code)
    act_dtype = parse_dtype(dtype) or default_compute_dtype(config, device)
    try:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=act_dtype, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, TypeError) as exc:
        raise QuantkitError(f"{folder}/config.json: cannot build the model ({str(exc).splitlines()[0]})") from None
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    specs = fmt.parse_quantization_config(qcfg, list(linears), {n: (m.out_features, m.in_features) for n, m in linears.items()})
    state = read_state_dict(files)
    for name, spec in specs.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        has_bias = f"{name}.bias" in state
        setattr(parent, child, QuantLinear(spec, fmt.NAME, bias=has_bias, dtype=act_dtype, backend=backend))
    _assign_state(model, state, folder)
    _cast_unquantized(model, act_dtype)
    model.to(device)
    model.eval()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.set_backend(backend)
    return model


def default_compute_dtype(config, device: torch.device) -> Optional[torch.dtype]:
    """float32 on CPU (its dense bf16 matmuls are ~2x slower here; the packed kernels cast to bf16
    themselves), the checkpoint's own dtype on accelerators."""
    from quantkit.sources import source_dtype

    if device.type == "cpu":
        return torch.float32
    return source_dtype(config) if config is not None else None


def _assign_state(model: nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    expected = model.state_dict()
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise QuantkitError(f"{folder}: tensor {unexpected[0]} (and {len(unexpected) - 1} more) does not belong to this "
                            "model; the config and the weights disagree")
    for key, tensor in state.items():
        want = expected[key]
        if tuple(want.shape) != tuple(tensor.shape):
            raise QuantkitError(f"{folder}: tensor {key} has shape {tuple(tensor.shape)}, the config implies "
                                f"{tuple(want.shape)}; the config and the weights disagree")
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    still_meta = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.device.type == "meta"]
    if still_meta:
        raise QuantkitError(f"{folder}: checkpoint is missing tensor {still_meta[0]} (and {len(still_meta) - 1} more)")


def _cast_unquantized(model: nn.Module, dtype: torch.dtype) -> None:
    from quantkit.runtime.quant_linear import QuantLinear

    for module in model.modules():
        if isinstance(module, QuantLinear):
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def _load_plain(folder: Path, files: list[Path], dtype, device, trust_remote_code: bool):
    """An unquantized HF folder (a baseline): plain transformers, safetensors only."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or "auto", use_safetensors=True,
                                                     trust_remote_code=trust_remote_code)
    except (OSError, ValueError, RuntimeError) as exc:
        raise QuantkitError(f"could not load {folder}: {str(exc).strip().splitlines()[0]}") from None
    return model.to(device).eval()


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    folder = resolve_checkpoint(path)
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise QuantkitError(f"{folder} has no usable tokenizer ({str(exc).splitlines()[0]})") from None
