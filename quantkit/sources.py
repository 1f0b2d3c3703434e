"""Where a full-precision model comes from: the bundled demo, a local HF folder, a GGUF file or a hub id.

Everything ends up as a plain transformers model (no `quantization_config`), so the calibration
driver and the writer never care where it came from.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError

from quantkit.errors import QuantkitError, first_line
from quantkit.finite import require_finite

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name in (None, "auto"):
        return None
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise QuantkitError(f"unknown dtype {name!r}; choose auto, float32, float16 or bfloat16")
    return DTYPES[name]


def resolve_model_path(model: str) -> str:
    """'demo' -> the converted demo folder; a path stays a path; anything else is a hub id."""
    if model == "demo":
        from quantkit.assets import demo_model_dir

        return str(demo_model_dir())
    return model


def stored_dtype(path: str, trust_remote_code: bool = False) -> torch.dtype:
    """The dtype a model folder declares in its config.json, before any loading casts it."""
    from transformers import AutoConfig

    return source_dtype(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))


def source_dtype(config) -> torch.dtype:
    """The dtype the source checkpoint was stored in (what unquantized tensors are written back as)."""
    d = getattr(config, "source_dtype", None) or getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = DTYPES.get(d, torch.float16)
    return d if isinstance(d, torch.dtype) and d.is_floating_point else torch.float16


def load_source_model(model: str, dtype: Optional[torch.dtype] = torch.float32, trust_remote_code: bool = False,
                      streaming: Optional[bool] = False, device_map: Optional[str] = None, max_memory=None):
    """Load (model, tokenizer, name_for_card, layer_source) in `dtype` (None: as stored) on CPU; refuses quantized folders.

    `layer_source` is None for a whole model in memory; with streaming (True, or None = decide from
    the model's size against available memory) the decoder layers stay on the meta device and the
    returned LazyLayers reads each from disk when the driver gets to it. With device_map="auto" each
    decoder layer goes where accelerate's device map puts it (quantkit.placement; `max_memory` in
    accelerate's form), the layers it leaves on disk streamed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(model)
    p = Path(path)
    if p.suffix == ".gguf":
        if streaming:
            raise QuantkitError("streaming needs a safetensors model folder, not a GGUF file; drop --streaming")
        from quantkit.formats.gguf.source import load_gguf_model

        return (*load_gguf_model(p, dtype), None)
    looks_local = p.exists() or path.startswith((".", "/", "~")) or path.count("/") > 1
    if looks_local and not p.exists():
        raise QuantkitError(f"model path {path} does not exist; pass an HF folder, a .gguf file, a hub id or 'demo'")
    if not looks_local:
        snapshot = cached_snapshot(path)
        if snapshot is not None:  # transformers will read this snapshot: the same checks as a folder
            check_model_folder(snapshot)
    if p.is_dir():
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise QuantkitError(f"{path} has no config.json; point --model at a Hugging Face model folder")
        try:
            cfg = json.loads(cfg_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise QuantkitError(f"{cfg_file} is not valid JSON ({first_line(exc)}); fix or re-download the model") from None
        if not isinstance(cfg, dict):
            raise QuantkitError(f"{cfg_file} holds {type(cfg).__name__}, not a JSON object; fix or re-download the model")
        if cfg.get("quantization_config"):
            qcfg = cfg["quantization_config"]
            method = qcfg.get("quant_method", "?") if isinstance(qcfg, dict) else "?"
            raise QuantkitError(f"{path} is already quantized ({method}); quantize a full-precision model")
        check_model_folder(p)
        from quantkit.model_files import check_remote_code

        check_remote_code(p, cfg, trust_remote_code)
    if streaming and not p.is_dir():
        raise QuantkitError(f"streaming needs a local safetensors model folder, not {path}; drop --streaming")
    if device_map is not None and (device_map != "auto" or not p.is_dir() or streaming is False):
        raise QuantkitError("--device-map takes 'auto', with a local safetensors model folder (its layers placed on "
                            f"disk are streamed, so not with --no-streaming); got {device_map!r} for {path}")
    layer_source = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if streaming is None and p.is_dir():
            from quantkit.streaming import should_stream

            streaming = should_stream(p, dtype or torch.float32)
        if device_map is not None:
            from quantkit.placement import load_placed_model

            hf_model, layer_source = load_placed_model(p, dtype or stored_dtype(path, trust_remote_code), max_memory,
                                                       trust_remote_code)
        elif streaming:
            from quantkit.streaming import load_streaming_model

            hf_model, layer_source = load_streaming_model(p, dtype or torch.float32, trust_remote_code)
        else:
            hf_model, info = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype or "auto", trust_remote_code=trust_remote_code, low_cpu_mem_usage=True,
                use_safetensors=True, output_loading_info=True)
            _refuse_missing_weights(info.get("missing_keys") or (), path)
    except QuantkitError:
        raise
    except (OSError, ValueError, RuntimeError, SafetensorError, StrictDataclassError, KeyError, TypeError,
            AttributeError, OverflowError, MemoryError) as exc:
        # damaged weights (a truncated shard, a header pointing past the end) or a config they disagree with
        raise QuantkitError(f"could not load model {path}: {first_line(exc)}; check or re-create its files") from None
    hf_model.eval()
    _check_finite(hf_model, path)
    hf_model.config.source_dtype = str(stored_dtype(path, trust_remote_code)).replace("torch.", "")
    return hf_model, tokenizer, _card_name(model, path), layer_source


def _refuse_missing_weights(missing, path: str) -> None:
    """transformers fills a weight the files lack with random values (a shard's index that leaves a
    tensor out, a config with more layers than the weights): quantizing that would be silently wrong."""
    if missing:
        names = sorted(missing)
        raise QuantkitError(f"{path} lacks {len(names)} weight(s) its config needs (e.g. {names[0]}); the config, "
                            "index and shards disagree: re-create or re-download the model")


def _check_finite(model, path: str) -> None:
    """Every loaded tensor finite (streamed layers are checked as they are read, quantkit.streaming):
    a NaN in a norm or embedding would otherwise be written into the output unnoticed."""
    for name, tensor in model.state_dict().items():
        require_finite(name, tensor, path)


def cached_snapshot(repo_id: str) -> Optional[Path]:
    """The Hugging Face cache's snapshot folder of `repo_id` (the revision its config.json resolves
    to), None when it is not cached or not a valid repository id."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - an id huggingface_hub rejects is transformers' to report
        return None
    return Path(found).parent if isinstance(found, str) else None


def check_model_folder(folder: Path) -> None:
    """Before any loader (transformers', streaming's, placement's) reads `folder`: every symlink in it
    and every shard its index names stays inside it (quantkit.model_files)."""
    from quantkit.model_files import check_folder_links, safetensors_shards, single_safetensors

    check_folder_links(folder)
    if safetensors_shards(folder) is None and single_safetensors(folder) is None:
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth")):
            raise QuantkitError(f"{folder} holds only pickle weights (.bin/.pt), which quantkit never loads (unpickling "
                                "runs code); convert them to safetensors first")
        raise QuantkitError(f"{folder} has no model.safetensors or model.safetensors.index.json")


def _card_name(model: str, path: str) -> str:
    """The base model id for the model card (the original hub id for the demo)."""
    if model == "demo":
        from quantkit.assets import DEMO_BASE_MODEL

        return DEMO_BASE_MODEL
    return path


def copy_in_memory_model(model, tokenizer=None, streaming: Optional[bool] = None, device_map: Optional[str] = None):
    """An in-memory transformers model as (copy, tokenizer, name_for_card): quantkit calibrates and
    writes a CPU copy, so the caller's model is left untouched (this costs one more copy of the weights;
    pass the model's folder instead to avoid it, or to stream its layers). The tokenizer is the one
    given, else the one in `model.name_or_path` when that is a local folder."""
    import copy

    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise QuantkitError(f"an in-memory model must be a transformers PreTrainedModel, got {type(model).__name__}; "
                            "pass it, or its folder or hub id")
    if getattr(model.config, "quantization_config", None):
        raise QuantkitError("the given model is already quantized; quantize a full-precision model")
    if streaming or device_map is not None:
        raise QuantkitError("streaming and device_map read the layers from a folder; an in-memory model is already "
                            "in memory: drop them, or pass the model's folder")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise QuantkitError("the given model has weights on the meta device (offloaded or not loaded); pass its folder")
    tokenizer = tokenizer if tokenizer is not None else _folder_tokenizer(model.name_or_path)
    clone = copy.deepcopy(model).to("cpu").eval()
    dtypes = [p.dtype for p in model.parameters() if p.dtype.is_floating_point]
    stored = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32  # what it holds is what it is
    clone.config.source_dtype = str(stored).replace("torch.", "")
    return clone, tokenizer, model.name_or_path or model.config.model_type


def in_memory_identity(model) -> str:
    """What the resume fingerprint records of an in-memory model: its name and a hash of its weights."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"in-memory {model.name_or_path or model.config.model_type} (weights sha256 {digest.hexdigest()})"


def _folder_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    folder = Path(name_or_path) if name_or_path else None
    if folder is None or not folder.is_dir():
        raise QuantkitError(f"an in-memory model needs its tokenizer: pass tokenizer= (the model's name_or_path "
                            f"{name_or_path!r} is not a local folder to read one from)")
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise QuantkitError(f"could not load a tokenizer from {folder} ({first_line(exc)}); pass tokenizer=") from None
