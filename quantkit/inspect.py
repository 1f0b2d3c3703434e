"""`quantkit inspect`: what a checkpoint holds, read from its config and safetensors headers only."""
from __future__ import annotations

from torch import nn

from quantkit.errors import QuantkitError


def inspect_checkpoint(path: str) -> dict:
    from accelerate import init_empty_weights
    from safetensors import SafetensorError, safe_open
    from transformers import AutoModelForCausalLM

    from quantkit.formats import get_format
    from quantkit.model_files import check_remote_code, safetensors_files
    from quantkit.runtime.loader import (QUANT_METHOD_TO_FORMAT, experts_as_linears, quantized_specs, read_config,
                                         resolve_checkpoint, unquantized_config)
    from quantkit.sources import source_dtype

    folder = resolve_checkpoint(path)
    cfg = read_config(folder)
    check_remote_code(folder, cfg, False, None)
    qcfg = cfg.get("quantization_config") or {}
    method = qcfg.get("quant_method")
    if method is not None and method not in QUANT_METHOD_TO_FORMAT:
        raise QuantkitError(f"{folder}/config.json: unknown quant_method {method!r}")
    files = safetensors_files(folder)
    size = sum(f.stat().st_size for f in files)
    config = unquantized_config(folder, trust_remote_code=False)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    adapter = experts_as_linears(model)  # routed experts as the per-expert linears checkpoints store
    rename = adapter.checkpoint_name if adapter is not None else (lambda n: n)
    linears = {rename(n): (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    specs = {rename(n): s for n, s in quantized_specs(get_format(QUANT_METHOD_TO_FORMAT[method]), qcfg, model,
                                                       adapter).items()} if method else {}
    elem = source_dtype(config).itemsize
    n_params = 0
    try:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    shape = st.get_slice(key).get_shape()
                    if key.rsplit(".", 1)[0] not in specs:
                        count = 1
                        for d in shape:
                            count *= d
                        n_params += count
    except SafetensorError as exc:
        raise QuantkitError(f"{folder}: unreadable safetensors header ({exc})") from None
    original = n_params * elem + sum(o * i * elem for o, i in (linears[n] for n in specs))
    return {
        "path": str(folder),
        "quant_method": method or "none",
        "format": QUANT_METHOD_TO_FORMAT.get(method, "unquantized"),
        "quantized_linears": len(specs),
        "size_mb": size / 2**20,
        "original_size_mb": original / 2**20,
        "compression": original / size if size else 0.0,
        "layers": {n: {"bits": s.bits, "group_size": s.group_size, "sym": s.sym, "act_order": s.act_order,
                       **({"input_quant": s.input_quant} if s.input_quant else {}),
                       "shape": [s.out_features, s.in_features]} for n, s in specs.items()},
        **_moe_report(folder),
    }


def _moe_report(folder) -> dict:
    """A MoE checkpoint's calibration report (tokens per expert, experts left uncalibrated), if it has one."""
    import json

    from quantkit.checkpoint import MOE_REPORT

    path = folder / MOE_REPORT
    if not path.is_file():
        return {}
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise QuantkitError(f"{path} is not valid JSON; re-create the checkpoint") from None
    return {"moe": {k: v for k, v in report.items() if k != "per_expert"}}
