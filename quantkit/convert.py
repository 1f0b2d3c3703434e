"""`quantkit convert`: re-pack a checkpoint into another layout without touching a single weight.

A quantized checkpoint (gptq, awq, compressed-tensors) is unpacked by its format module into
`QuantizedWeight`s and packed by the target's: every grid value is carried over exactly, or the
target's packer refuses with one line naming what it cannot hold (an asymmetric grid for a
symmetric-only layout, per-group scales for a GGUF k-quant, ...). GGUF export keeps each tensor's
grid (one GGUF block type for the quantized linears, the stored float type for everything else);
an unquantized model converts to F32/F16/BF16 GGUF only. Output goes through a hidden staging
folder renamed into place, so a refusal leaves the destination as it was.
"""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from quantkit.checkpoint import normal_permissions, replace_dir, check_output_dir, model_card, write_safetensors
from quantkit.disk_errors import writing_output
from quantkit.errors import QuantkitError
from quantkit.formats import FORMATS, format_for_quant_method, get_format
from quantkit.formats.spec import LinearSpec
from quantkit.formats.gguf.types import MIXES, TYPES, check_gguf_type
from quantkit.model_files import check_remote_code
from quantkit.qtensor import QuantizedWeight

CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def convert(src: Union[str, Path], format: str, output: Union[str, Path], gguf_type: Optional[str] = None,
            overwrite: bool = False) -> dict[str, Any]:
    """Re-pack `src` as `format` ("gptq", "awq", "compressed-tensors" or "gguf") into `output`."""
    from quantkit.model_files import safetensors_files
    from quantkit.runtime.loader import experts_as_linears, read_config, resolve_checkpoint

    target = str(format).lower().replace("_", "-")
    if target not in (*FORMATS, "gguf"):  # before the checkpoint is read: the message is about the format
        raise QuantkitError(f"unknown --format {format!r}; choose one of {', '.join([*FORMATS, 'gguf'])}")
    folder = resolve_checkpoint(str(src))
    output = Path(output)
    check_output_dir(output, overwrite, source=folder)
    cfg = read_config(folder)
    check_remote_code(folder, cfg, False, None)
    qcfg = cfg.get("quantization_config") or None
    model = _empty_model(folder)
    adapter = experts_as_linears(model)  # MoE experts as the per-expert linears checkpoints store
    state = _read_state(safetensors_files(folder))
    qws = _unpack_all(qcfg, model, adapter, state, folder) if qcfg else {}
    stage = output.parent / f".{output.name}.convert-partial"
    # a failed convert leaves nothing (it has no progress to resume); the source's size bounds the output's
    with writing_output(output, lambda: sum(f.stat().st_size for f in safetensors_files(folder))):
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
        try:
            if target == "gguf":
                if adapter is not None and any(adapter.moe_blocks(layer) for layer in adapter.decoder_layers(model)):
                    raise QuantkitError("GGUF export of Mixture-of-Experts models is not supported (llama.cpp "
                                        "stores experts as 3-D tensors); convert to gptq, awq or compressed-tensors")
                kind = _to_gguf(folder, model, state, qws, gguf_type, output, stage, overwrite)
            else:
                if gguf_type is not None:
                    raise QuantkitError("--gguf-type needs --format gguf")
                kind = _to_layout(folder, cfg, model, adapter, state, qws, target, output, stage, overwrite)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    return {"source": str(folder), "output": str(output), "format": target, "quantized_linears": len(qws), **kind}


def _empty_model(folder: Path):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with init_empty_weights():
            return AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build from
        raise QuantkitError(f"{folder}/config.json: cannot build the model ({str(exc).splitlines()[0]})") from None


def _checkpoint_linears(model, adapter) -> dict[str, nn.Linear]:
    """The model's linears by the names its checkpoints give them (Mixtral: block_sparse_moe...w1)."""
    rename = adapter.checkpoint_name if adapter is not None else (lambda n: n)
    return {rename(n): m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _read_state(files) -> dict[str, torch.Tensor]:
    """Every tensor of the source, each float one finite: convert carries them over (or, into GGUF,
    rounds them) as they are, so a damaged one is refused here, named with its file."""
    from quantkit.finite import require_finite
    from quantkit.runtime.loader import read_state_dict

    state, where = read_state_dict(files, with_files=True)
    for name, tensor in state.items():
        require_finite(name, tensor, str(where[name]))
    return state


def _unpack_all(qcfg: dict, model, adapter, state: dict, folder: Path) -> dict[str, QuantizedWeight]:
    """Every quantized linear of the source as a QuantizedWeight (its format module validates the tensors)."""
    fmt = format_for_quant_method(qcfg)
    linears = _checkpoint_linears(model, adapter)
    specs = fmt.parse_quantization_config(qcfg, list(linears), {n: (m.out_features, m.in_features)
                                                                for n, m in linears.items()})
    out = {}
    for name, spec in specs.items():
        tensors = {**fmt.default_tensors(spec),
                   **{k[len(name) + 1:]: v for k, v in state.items() if k.rsplit(".", 1)[0] == name}}
        try:
            out[name] = fmt.unpack(tensors, spec)
        except QuantkitError as exc:
            raise QuantkitError(f"{folder}: {name}: {exc}") from None
    return out


def _to_layout(folder, cfg, model, adapter, state, qws, target, output, stage, overwrite) -> dict:
    if not qws:
        raise QuantkitError(f"{folder} is not quantized; convert re-packs quantized checkpoints (use `quantkit "
                            f"quantize --format {target}` to quantize, or `--format gguf --gguf-type F16`)")
    fmt = get_format(target)
    tensors = {k: v for k, v in state.items() if k.rsplit(".", 1)[0] not in qws or k.endswith(".bias")}
    specs = {}
    for name, qw in qws.items():
        try:
            packed = fmt.pack(qw)
        except QuantkitError as exc:
            raise QuantkitError(f"cannot convert {name} to {fmt.NAME} without loss: {exc}") from None
        tensors.update({f"{name}.{suffix}": t.contiguous() for suffix, t in packed.items()})
        specs[name] = LinearSpec.of(qw)
    source_q = cfg["quantization_config"]
    extra = {k: source_q[k] for k in ("true_sequential", "damp_percent") if k in source_q and target == "gptq"}
    fixed = [adapter.checkpoint_name(n) for n in adapter.full_precision_modules(model)] if adapter is not None else []
    ignore = sorted({n for n in _checkpoint_linears(model, adapter) if n not in qws} | set(fixed))
    try:
        qcfg = fmt.quantization_config(specs, ignore, extra)
    except QuantkitError as exc:
        raise QuantkitError(f"cannot describe these weights as {fmt.NAME}: {exc}") from None
    write_safetensors(stage / "model.safetensors", {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()},
                      lambda k: tensors[k], metadata={"format": "pt"})
    import json

    (stage / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}, indent=2, sort_keys=True) + "\n")
    _carry_files(folder, stage)
    method = {"method": "convert", "source": str(folder), "source_format": source_q.get("quant_method")}
    (stage / "README.md").write_text(model_card(str(folder), fmt.NAME, method, qcfg, specs))
    normal_permissions(stage)
    replace_dir(stage, output)
    return {}


def _carry_files(folder: Path, stage: Path) -> None:
    for name in CARRIED_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, stage / name)


def _to_gguf(folder, model, state, qws, gguf_type, output, stage, overwrite) -> dict:
    from quantkit.formats.gguf.export import default_gguf_type, float_type_of, write_gguf_folder
    from quantkit.formats.gguf.plan import plan_model
    from quantkit.runtime.loader import load_tokenizer

    if gguf_type is None:
        if not qws:
            raise QuantkitError("an unquantized model converts to a float GGUF: pass --gguf-type F16, BF16 or F32")
        first = next(iter(qws.values()))
        gguf_type = default_gguf_type(first.bits, first.sym)
    gguf_type = check_gguf_type(gguf_type)
    block = TYPES[MIXES.get(gguf_type, gguf_type)]
    if gguf_type in MIXES:
        raise QuantkitError(f"{gguf_type} re-chooses types per tensor, which changes weights; convert keeps each "
                            "tensor's grid: pass a block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or quantize with "
                            "`quantkit quantize --format gguf`")
    if block.quantized and not qws:
        raise QuantkitError(f"{folder} is not quantized: {gguf_type} would round it; use `quantkit quantize --format "
                            f"gguf --gguf-type {gguf_type}` (or --gguf-type F16/BF16/F32 here)")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    plan = plan_model(shapes, model.config, "F32")

    def exact_type(p):  # quantized linears take the block type; every other tensor keeps its stored type
        if p.hf_name[:-len(".weight")] in qws or len(p.shape) < 2:
            return p.type if len(p.shape) < 2 else block
        return block if not block.quantized else TYPES[float_type_of(state[p.hf_name].dtype)]

    def fetch(hf_name: str):
        module = hf_name[:-len(".weight")]
        if module in qws:
            return qws[module] if block.quantized else qws[module].dequantize()
        return state[hf_name]

    typed = [replace(p, type=exact_type(p)) for p in plan]
    write_gguf_folder(output, stage, model, load_tokenizer(str(folder)), gguf_type, fetch, str(folder),
                      {"method": "convert", "source": str(folder)}, overwrite=overwrite, plan=typed)
    return {"gguf_type": gguf_type}
