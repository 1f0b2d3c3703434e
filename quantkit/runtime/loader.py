"""Load a quantized checkpoint for inference without ever materialising full-precision weights.

The skeleton is built on the meta device (accelerate's `init_empty_weights`), every linear the
checkpoint's `quantization_config` names is swapped for a `QuantLinear` holding the packed
tensors, and the state dict is assigned straight from safetensors. Only safetensors are read:
no pickle, ever.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from quantkit.errors import QuantkitError, first_line
from quantkit.finite import require_finite
from quantkit.model_files import check_folder_links, check_remote_code, model_file, safetensors_files

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
    check_folder_links(p)  # config and tokenizer files are read by transformers: none may lead outside
    return p


def gguf_model_file(path: str) -> Optional[Path]:
    """The GGUF file behind `path`: a .gguf file itself, or a folder quantkit wrote with --format gguf."""
    p = Path(path)
    if p.suffix == ".gguf" and p.is_file():
        return p
    if p.is_dir() and (p / "config.json").is_file():
        qcfg = read_config(p).get("quantization_config")
        if isinstance(qcfg, dict) and qcfg.get("quant_method") == "gguf":
            check_folder_links(p)
            return model_file(p, qcfg.get("gguf_file", "model.gguf"), "config.json's gguf_file")
    return None


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


def read_state_dict(files: list[Path], with_files: bool = False):
    """All tensors of the checkpoint (and, with `with_files`, tensor name -> the file it came from)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except (SafetensorError, OSError, ValueError, RuntimeError, TypeError, KeyError, OverflowError,
                MemoryError) as exc:
            raise QuantkitError(f"{f} is not a valid safetensors file ({first_line(exc)}); re-download or re-create it") from None
        dup = state.keys() & tensors.keys()
        if dup:
            raise QuantkitError(f"{f} repeats tensor {sorted(dup)[0]} from another shard")
        state.update(tensors)
        where.update(dict.fromkeys(tensors, f))
    return (state, where) if with_files else state


def _check_layer_count(config, state: dict[str, torch.Tensor], folder: Path) -> None:
    """A config claiming far more decoder layers than the weights hold would have us build (and
    then reject) millions of modules; compare with the highest `layers.N.` index first."""
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int) or isinstance(n, bool):
        return
    indices = [int(m.group(1)) for m in map(_LAYER_INDEX.search, state) if m]
    if indices and n > max(indices) + 1:
        raise QuantkitError(f"{folder}/config.json says num_hidden_layers={n}, the weights hold "
                            f"{max(indices) + 1} layers; the config and the weights disagree")


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def _check_packed_tensors(fmt, specs, state: dict[str, torch.Tensor], where: dict[str, Path], folder: Path) -> None:
    """Every packed tensor a quantized linear needs is there with the format's shape, before any
    buffer is allocated: a config lying about shapes must not make us allocate its sizes, and a
    missing tensor must not leave a zero-filled buffer behind."""
    for name, spec in specs.items():
        try:
            shapes = fmt.packed_shapes(spec)
            optional = set(fmt.default_tensors(spec))
        except QuantkitError as exc:
            raise QuantkitError(f"{folder}/config.json: {name}: {exc}") from None
        for suffix, (shape, dtype) in shapes.items():
            key = f"{name}.{suffix}"
            if key not in state:
                if suffix in optional:
                    continue
                raise QuantkitError(f"{folder}: checkpoint is missing tensor {key} (quantized {fmt.NAME} linear)")
            t = state[key]
            if tuple(t.shape) != tuple(shape):
                raise QuantkitError(f"{where[key]}: tensor {key} has shape {tuple(t.shape)}, the config implies "
                                    f"{tuple(shape)}; the config and the weights disagree")
            if t.is_floating_point() != dtype.is_floating_point:
                raise QuantkitError(f"{where[key]}: tensor {key} has dtype {str(t.dtype).replace('torch.', '')}, "
                                    f"expected {str(dtype).replace('torch.', '')}")


def unquantized_config(folder: Path, trust_remote_code: bool):
    """The folder's transformers config without its quantization_config (so transformers builds plain
    linears for quantkit to replace), its sizes and epsilons checked; QuantkitError when unusable."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises anything on a garbage config; none of it is ours
        raise QuantkitError(f"{folder}/config.json is not a usable model config ({first_line(exc)})") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    _check_config_values(config, folder)
    return config


_POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "vocab_size", "max_position_embeddings", "head_dim", "ffn_dim")
_NON_NEGATIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta")


def _check_config_values(config, folder: Path) -> None:
    """Sizes must be positive integers and epsilons finite and non-negative: transformers accepts
    almost anything here and then computes garbage (a negative eps turns every logit into NaN)."""
    for key in _POSITIVE_INTS:
        v = getattr(config, key, None)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise QuantkitError(f"{folder}/config.json: {key} must be a positive integer, got {v!r}")
    for key in _NON_NEGATIVE_FLOATS:
        v = getattr(config, key, None)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0):
            raise QuantkitError(f"{folder}/config.json: {key} must be a finite non-negative number, got {v!r}")


def load_model(path: str, backend: str = "auto", device: Optional[str] = None, dtype: Optional[str] = None,
               trust_remote_code: bool = False):
    """A transformers causal LM whose quantized linears are `QuantLinear`s on `backend`."""
    from quantkit.devices import compute_device
    from quantkit.runtime.backends import BACKENDS
    from quantkit.sources import parse_dtype

    if backend not in BACKENDS:  # checked here too: a model with nothing quantized never asks for a backend
        raise QuantkitError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    device = compute_device(device)
    gguf_file = gguf_model_file(path)
    if gguf_file is not None:  # llama.cpp's file: dequantized by quantkit's own GGUF reader
        from quantkit.sources import load_source_model

        model = load_source_model(str(gguf_file), dtype=None)[0]
        return model.to(device=device, dtype=parse_dtype(dtype) or torch.float32)
    folder = resolve_checkpoint(path)
    cfg = read_config(folder)
    check_remote_code(folder, cfg, trust_remote_code, "trust_remote_code=True to quantkit.load")
    qcfg = cfg.get("quantization_config")
    files = safetensors_files(folder)
    if not qcfg:
        return _load_plain(folder, files, parse_dtype(dtype) or default_compute_dtype(None, device), device,
                           trust_remote_code)
    if not isinstance(qcfg, dict):
        raise QuantkitError(f"{folder}/config.json: quantization_config must be an object")
    method = qcfg.get("quant_method")
    if method not in QUANT_METHOD_TO_FORMAT:
        raise QuantkitError(f"{folder}/config.json: unknown quant_method {method!r}; quantkit reads "
                            f"{', '.join(QUANT_METHOD_TO_FORMAT)}")
    from quantkit.formats.ct_float_layouts import is_float_config

    if method == "compressed-tensors" and is_float_config(qcfg):  # FP8 / NVFP4 / MXFP4: runtime.float_loader
        from quantkit.runtime.float_loader import load_float_model

        return load_float_model(folder, qcfg, files, backend, device, dtype, trust_remote_code)
    from quantkit.formats import get_format
    from quantkit.runtime.quant_linear import QuantLinear

    fmt = get_format(QUANT_METHOD_TO_FORMAT[method])
    model, act_dtype, state, where, adapter = empty_model_and_state(folder, files, dtype, device, trust_remote_code)
    try:
        specs = quantized_specs(fmt, qcfg, model, adapter)
    except QuantkitError as exc:
        raise QuantkitError(f"{folder}/config.json: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise QuantkitError(f"{folder}/config.json: malformed quantization_config ({first_line(exc)})") from None
    _check_packed_tensors(fmt, specs, state, where, folder)
    for name, spec in specs.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        has_bias = f"{name}.bias" in state
        module = QuantLinear(spec, fmt.NAME, bias=has_bias, dtype=act_dtype, backend=backend)
        packed_file = next((where[f"{name}.{s}"] for s in module._packed_names if f"{name}.{s}" in where), folder)
        module.source = f"{packed_file} ({name})"  # unpacking (first forward) names the file in its errors
        setattr(parent, child, module)
    fill_and_place(model, state, where, folder, act_dtype, device)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.set_backend(backend)
    return model


def empty_model_and_state(folder: Path, files: list[Path], dtype: Optional[str], device: torch.device,
                          trust_remote_code: bool):
    """(the model built on the meta device from the checkpoint's unquantized config, its compute dtype, the
    checkpoint's tensors and the file each came from, both keyed by the model's names, the MoE adapter or
    None): what every quantized loader starts from before it swaps in its own linears."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from quantkit.sources import parse_dtype

    config = unquantized_config(folder, trust_remote_code)
    act_dtype = parse_dtype(dtype) or default_compute_dtype(config, device)
    state, where = read_state_dict(files, with_files=True)
    _check_layer_count(config, state, folder)
    try:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=act_dtype, trust_remote_code=trust_remote_code)
    except Exception as exc:  # a config transformers cannot build from (zero heads, wrong types, ...)
        raise QuantkitError(f"{folder}/config.json: cannot build the model ({first_line(exc)})") from None
    adapter = experts_as_linears(model)
    if adapter is not None:  # the checkpoint's names (Mixtral's block_sparse_moe.experts.e.w1) -> the model's
        state, where = ({adapter.model_name(k): v for k, v in d.items()} for d in (state, where))
    from quantkit.runtime.kv_scales import take_kv_scales

    take_kv_scales(read_config(folder).get("quantization_config"), state, where, model, folder)  # FP8 KV scales
    return model, act_dtype, state, where, adapter


def fill_and_place(model: nn.Module, state: dict, where: dict, folder: Path, act_dtype: torch.dtype,
                   device: torch.device) -> None:
    """The rest of the checkpoint's tensors into `model` (its quantized linears already swapped in), the
    unquantized ones cast to `act_dtype`, all on `device`, in eval mode."""
    _assign_state(model, state, folder, where)
    _cast_unquantized(model, act_dtype)
    model.to(device)
    model.eval()


def experts_as_linears(model: nn.Module):
    """Replace every fused experts module of a (meta) MoE model by per-expert linears, which is how
    quantized checkpoints store experts (``experts.{e}.gate_proj.qweight``). Returns the family's
    adapter (None for an architecture quantkit has no adapter for: nothing to replace)."""
    from quantkit.models import get_adapter
    from quantkit.models.experts import RoutedExperts, check_fused

    try:
        adapter = get_adapter(model)
    except QuantkitError:
        return None
    for layer in adapter.decoder_layers(model):
        for block in adapter.moe_blocks(layer):
            parent_name, _, child = block.experts.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            fused = getattr(parent, child)
            e, h, i = check_fused(fused)
            setattr(parent, child, RoutedExperts(e, h, i, fused.act_fn, device=fused.gate_up_proj.device,
                                                 dtype=fused.gate_up_proj.dtype))
    return adapter


def quantized_specs(fmt, qcfg: dict, model: nn.Module, adapter) -> dict:
    """The quantization_config's LinearSpec per quantized linear of `model` (model names); the
    config's rules are matched against the checkpoint's names."""
    rename = adapter.checkpoint_name if adapter is not None else (lambda n: n)
    linears = {rename(n): n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    shapes = {c: (model.get_submodule(n).out_features, model.get_submodule(n).in_features) for c, n in linears.items()}
    return {linears[c]: spec for c, spec in fmt.parse_quantization_config(qcfg, list(linears), shapes).items()}


def default_compute_dtype(config, device: torch.device) -> Optional[torch.dtype]:
    """float32 on CPU (its dense bf16 matmuls are ~2x slower here; the packed kernels cast to bf16
    themselves), the checkpoint's own dtype on accelerators."""
    from quantkit.sources import source_dtype

    if device.type == "cpu":
        return torch.float32
    return source_dtype(config) if config is not None else None


def _assign_state(model: nn.Module, state: dict[str, torch.Tensor], folder: Path,
                  where: Optional[dict[str, Path]] = None) -> None:
    expected = model.state_dict()
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise QuantkitError(f"{(where or {}).get(unexpected[0], folder)}: tensor {unexpected[0]} (and {len(unexpected) - 1} more) does not belong to this "
                            "model; the config and the weights disagree")
    for key, tensor in state.items():
        want = expected[key]
        src = (where or {}).get(key, folder)  # the shard file that holds it
        if tuple(want.shape) != tuple(tensor.shape):
            raise QuantkitError(f"{src}: tensor {key} has shape {tuple(tensor.shape)}, the config implies "
                                f"{tuple(want.shape)}; the config and the weights disagree")
        if want.is_floating_point() != tensor.is_floating_point() or tensor.is_complex():
            raise QuantkitError(f"{src}: tensor {key} has dtype {str(tensor.dtype).replace('torch.', '')}, "
                                f"expected {str(want.dtype).replace('torch.', '')}")
        require_finite(key, tensor, str(src))
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

    read_state_dict(files)  # a corrupt file is named as such, not as whatever transformers trips over
    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or "auto", use_safetensors=True,
                                                           trust_remote_code=trust_remote_code, output_loading_info=True)
    except Exception as exc:  # garbage configs make transformers raise anything
        raise QuantkitError(f"could not load {folder}: {first_line(exc)}") from None
    # transformers fills missing weights with random values and drops unknown ones, with a log line
    # at most: for a checkpoint that is corruption, not a model
    for kind, what in (("missing_keys", "is missing tensor"), ("unexpected_keys", "holds unexpected tensor"),
                       ("mismatched_keys", "has a wrongly shaped tensor")):
        keys = sorted(str(k) for k in (info.get(kind) or []))
        if keys:
            raise QuantkitError(f"{folder} {what} {keys[0]} (and {len(keys) - 1} more); the config and the weights "
                                "disagree")
    for name, t in model.state_dict().items():
        require_finite(name, t, str(folder))
    return model.to(device).eval()


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    gguf_file = gguf_model_file(path)
    if gguf_file is not None and Path(path).is_file():
        from quantkit.formats.gguf.source import load_gguf_tokenizer

        return load_gguf_tokenizer(gguf_file)
    folder = resolve_checkpoint(path)
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:  # damaged tokenizer files
        raise QuantkitError(f"{folder} has no usable tokenizer ({first_line(exc)}); re-create its tokenizer "
                            "files") from None
