"""The two entry points the API calls: measure a model's sensitivity report, and choose a mixture
from a report for a `--target-bits` / `--target-size` budget."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from quantkit.allocation import interaction, mixture
from quantkit.allocation.budget import candidate_costs, fixed_bytes, human_size, parse_size
from quantkit.allocation.sensitivity import CANDIDATE_BITS, candidates_for, measure, scheme_label
from quantkit.errors import QuantkitError

# formats that store a different scheme per linear, and what each writes for the mixture
MIXTURE_FORMATS = {"gptq": "GPTQModel `dynamic` rules in quantization_config",
                   "compressed-tensors": "one config group per scheme"}


def check_format_carries_mixture(format_name: str, gguf_type: Optional[str]) -> None:
    """Refuse, with the reason, a format that cannot hold one scheme per linear."""
    if gguf_type is not None or format_name == "gguf":
        raise QuantkitError("--target-bits/--target-size: writing an allocated mixture as GGUF per-tensor types is not "
                            "implemented yet (GGUF's own mixes: --gguf-type Q4_K_M); use --format gptq or "
                            "compressed-tensors")
    if format_name not in MIXTURE_FORMATS:
        raise QuantkitError(f"--target-bits/--target-size: the {format_name} format stores one scheme for every linear "
                            f"(awq: 4-bit only), so it cannot carry a mixture; use --format gptq or compressed-tensors")


def measure_report(hf_model, adapter, plan, schemes: dict, calibration_ids: torch.Tensor, eval_windows: torch.Tensor, *,
                   model_label: str, save_dtype: torch.dtype, batch_size: int = 4, sample: int = 8,
                   measure_layers: bool = True, measure_linears: bool = False, measure_at=None, bits=CANDIDATE_BITS,
                   seed: int = 0,
                   info: Optional[dict] = None, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The sensitivity report of a full-precision (fp32) model: one row per linear and candidate scheme."""
    from quantkit.formats import get_format

    check_format_carries_mixture(plan.format, plan.gguf_type)
    if plan.recipe.quantizes_activations:
        raise QuantkitError(f"method {plan.recipe.name!r} quantizes activations; sensitivity and allocation cover "
                            "weight-only schemes")
    fmt = get_format(plan.format)
    shapes = {n: s for n, s in adapter.linear_shapes(hf_model).items() if n in schemes}
    # a candidate whose group size does not divide a linear's input width is not one of its candidates
    candidates = {n: tuple(c for c in candidates_for(s, bits) if c.group_size == -1 or shapes[n][1] % c.group_size == 0)
                  for n, s in schemes.items()}
    for n, c in candidates.items():
        if not c:
            raise QuantkitError(f"{n}: no candidate's group size divides its input width {shapes[n][1]}; "
                                "add a candidate with a group size that does (or per channel, e.g. w4pc)")
    costs = candidate_costs(fmt, plan.recipe, shapes, candidates)
    candidates = {n: tuple(s for s in c if s in costs[n]) for n, c in candidates.items()}
    prefix = adapter.layers_prefix(hf_model)
    measured = measure(hf_model, adapter, candidates, plan.recipe.quantizer, calibration_ids, eval_windows,
                       batch_size=batch_size, sample=sample, measure_layers=measure_layers,
                       measure_linears=measure_linears, seed=seed, progress=progress,
                       anchors=None if measure_at is None else tuple(
                           scheme_label(s) for s in candidates_for(next(iter(schemes.values())), measure_at)))
    labelled = {n: {scheme_label(s): b for s, b in c.items()} for n, c in costs.items()}
    rows = mixture.table_rows(measured, labelled, candidates, shapes, prefix)
    uniforms = {label: mixture.summary(u) for label in measured["labels"]
                if (u := mixture.uniform(rows, label)) is not None}
    fit_points = [{"scheme": label, "predicted_kl_sum": u["predicted_kl_sum"], "measured_kl": measured["whole_kl"][label]}
                  for label, u in uniforms.items() if label in measured["whole_kl"]]
    mapping = interaction.fit([(p["predicted_kl_sum"], p["measured_kl"]) for p in fit_points])
    for label, u in uniforms.items():
        uniforms[label] = {**mixture.summary(mixture.uniform(rows, label), mapping),
                           "measured_kl": measured["whole_kl"].get(label)}
    checks = mixture_checks(rows, uniforms, mapping, measured["kl_of_mixture"], progress)
    layers = [{"layer": i, "scheme": label, "measured_kl": kl,
               "predicted_kl": sum(r["predicted_kl"] for r in rows if r["layer"] == i and r["scheme"] == label)}
              for (i, label), kl in sorted(measured["layer_kl"].items(), key=lambda kv: (kv[0][0] or 0, kv[0][1]))]
    return {"model": model_label, "method": plan.recipe.name, "quantizer": plan.recipe.quantizer.name,
            "format": plan.format, **(info or {}),
            "schemes": measured["labels"], "calibration_mode": measured["calibration_mode"],
            "measured_forwards": measured["forwards"], "seconds": measured["seconds"],
            "fixed_bytes": fixed_bytes(hf_model, set(schemes), save_dtype),
            "proxy_check": measured["check"], "layers": layers, "uniform": uniforms,
            "interaction": {"fit": fit_points, "mapping": mapping, "check": checks},
            "curve": mixture.size_curve(rows, mapping=mapping), "rows": rows}


def mixture_checks(rows, uniforms, mapping, kl_of_mixture, progress, most: int = 3) -> list[dict[str, Any]]:
    """Out-of-sample check of the predicted KL: the best mixtures at budgets halfway between consecutive
    uniform schemes' sizes (mixtures the interaction mapping was not fitted on), measured whole."""
    sizes = sorted({u["packed_bytes"] for u in uniforms.values()})
    budgets = [(a + b) // 2 for a, b in zip(sizes, sizes[1:])]
    if len(budgets) > most:  # spread over the range
        budgets = [budgets[round(i * (len(budgets) - 1) / (most - 1))] for i in range(most)]
    out = []
    for budget in budgets:
        choice = mixture.allocate(rows, budget)
        s = mixture.summary(choice, mapping)
        progress(f"mixture check at {s['bits_per_weight']:.3f} bits per weight")
        measured_kl = kl_of_mixture({n: r["scheme"] for n, r in choice.items()})
        out.append({"bits_per_weight": s["bits_per_weight"], "schemes": s["schemes"],
                    "predicted_kl_sum": s["predicted_kl_sum"], "predicted_kl": s["predicted_kl"],
                    "measured_kl": measured_kl,
                    "predicted_over_measured": s["predicted_kl"] / measured_kl if measured_kl > 0 else None})
    return out


def read_report(path) -> dict[str, Any]:
    """A report written by `quantkit sensitivity` (JSON only: nothing executable is read)."""
    from quantkit.allocation.report import JSON_FILE

    p = Path(path)
    p = p / JSON_FILE if p.is_dir() else p
    try:
        report = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise QuantkitError(f"--sensitivity {path}: cannot read a sensitivity report ({exc}); give the folder or "
                            "sensitivity.json that `quantkit sensitivity` wrote") from None
    if not isinstance(report, dict) or not isinstance(report.get("rows"), list):
        raise QuantkitError(f"--sensitivity {path}: not a sensitivity report (no 'rows'); run `quantkit sensitivity`")
    return report


def recost(rows: list[dict[str, Any]], plan) -> list[dict[str, Any]]:
    """The rows with their bytes counted for this run's format (a report measured for gptq serves a
    compressed-tensors run too: predicted KL depends on the quantizer, bytes on the layout); rows
    of a scheme the format cannot store are left out."""
    from quantkit.allocation.budget import packed_bytes
    from quantkit.formats import get_format

    fmt, out = get_format(plan.format), []
    for r in rows:
        if "shape" not in r:
            raise QuantkitError("the sensitivity report has no linear shapes (an older report); measure it again")
        try:
            nbytes = packed_bytes(fmt, plan.recipe.planned_spec(*r["shape"], mixture.row_scheme(r)))
        except QuantkitError:
            continue
        out.append({**r, "bytes": nbytes, "bits_per_weight": round(8 * nbytes / r["weights"], 4)})
    return out


def choose_mixture(report: dict[str, Any], plan, schemes: dict, *, target_bits: Optional[float] = None,
                   target_size: Optional[str] = None) -> tuple[dict, dict[str, Any]]:
    """The schemes of the linears (name -> LinearScheme) chosen for the budget, and what to record of it."""
    if (target_bits is None) == (target_size is None):
        raise QuantkitError("give one of --target-bits and --target-size")
    quantizer = plan.recipe.quantizer.name
    if report.get("quantizer", quantizer) != quantizer:
        raise QuantkitError(f"the sensitivity report measured {report['quantizer']}'s errors, but this run quantizes "
                            f"with {quantizer}; measure it with `quantkit sensitivity --method {plan.recipe.name}`")
    rows = recost([r for r in report["rows"] if r["linear"] in schemes], plan)
    covered = {r["linear"] for r in rows}
    if covered != set(schemes):
        missing = sorted(set(schemes) - covered)
        raise QuantkitError(f"the sensitivity report has no rows for {len(missing)} linear(s) of this model (e.g. "
                            f"{missing[0]}); measure this model with `quantkit sensitivity`")
    weights = sum(shape[0]["weights"] for shape in mixture.by_linear(rows).values())
    if target_bits is not None:
        if not isinstance(target_bits, (int, float)) or isinstance(target_bits, bool) or target_bits <= 0:
            raise QuantkitError(f"--target-bits must be a positive number, got {target_bits!r}")
        budget, what = int(target_bits * weights / 8), f"--target-bits {target_bits}"
        target = f"{target_bits} bits per weight (packed: codes, scales, zero points, g_idx)"
    else:
        total = parse_size(target_size)
        budget, what = total - int(report["fixed_bytes"]), f"--target-size {target_size}"
        target = f"{target_size} ({total} bytes of safetensors files)"
        floor = sum(min(r["bytes"] for r in rs) for rs in mixture.by_linear(rows).values())
        if budget < floor:
            raise QuantkitError(f"{what} is below the smallest possible size, {human_size(floor + report['fixed_bytes'])} "
                                f"({floor + report['fixed_bytes']} bytes: every linear at its smallest scheme); "
                                "raise the target")
    choice = mixture.allocate(rows, budget, what)
    # each linear gets its chosen scheme as an override (bits, group size and symmetry), so a report's
    # candidates may differ from the run's own group size (w4g128 beside w4g32)
    chosen = {n: mixture.row_scheme(r) for n, r in choice.items()}
    mapping = (report.get("interaction") or {}).get("mapping")
    return chosen, {"target": target, **mixture.summary(choice, mapping),
                    "choice": {n: r["scheme"] for n, r in choice.items()}}


EVAL_WINDOWS = 8  # held-out windows each KL measurement scores (a forward of the model each)
EVAL_SEQ_LEN = 512


def sensitivity_of_model(model: str, plan, *, calibration: Optional[dict] = None, trust_remote_code: bool = False,
                         eval_dataset=None,
                         eval_windows: int = EVAL_WINDOWS, eval_seq_len: int = EVAL_SEQ_LEN, sample: int = 8,
                         measure_layers: bool = True, measure_linears: bool = True, measure_at=None,
                         bits=CANDIDATE_BITS,
                         batch_size: int = 4,
                         progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Load `model` in fp32 and measure its report for `plan` (the calibration set is the plan's, or the
    default one for a method that reads none, with the keys of `calibration` over it; KL is scored on the held-out split of `eval_dataset`,
    default the calibration dataset)."""
    from quantkit import data
    from quantkit.models import get_adapter
    from quantkit.plan import CALIBRATION_DEFAULTS
    from quantkit.sources import load_source_model, source_dtype

    for what, value in (("--eval-windows", eval_windows), ("--eval-seq-len", eval_seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (2 if "seq" in what else 1):
            raise QuantkitError(f"{what} must be a positive integer (a sequence length at least 2), got {value!r}")
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 0:
        raise QuantkitError(f"--sample must be a non-negative integer, got {sample!r}")
    if not measure_linears and not measure_layers and sample == 0:
        raise QuantkitError("nothing would be measured to calibrate the proxy: keep --measure-layers or give --sample")
    hf_model, tokenizer, base_name, _ = load_source_model(model, dtype=torch.float32,
                                                          trust_remote_code=trust_remote_code, streaming=False)
    save_dtype = source_dtype(hf_model.config)
    adapter = get_adapter(hf_model)
    schemes = plan.scheme.resolve(adapter.linear_shapes(hf_model))
    c = plan.calibration
    cal = ({"dataset": c.dataset, "num_samples": c.num_samples, "seq_len": c.seq_len, "seed": c.seed}
           if c is not None else {k: CALIBRATION_DEFAULTS[k] for k in ("dataset", "num_samples", "seq_len", "seed")})
    cal.update(calibration or {})
    ids = data.calibration_batches(cal["dataset"], tokenizer, num_samples=cal["num_samples"], seq_len=cal["seq_len"],
                                   seed=cal["seed"], chat_template=bool(c and c.chat_template))
    eval_set = eval_dataset if eval_dataset is not None else (
        cal["dataset"] if isinstance(cal["dataset"], (str, Path)) else CALIBRATION_DEFAULTS["dataset"])
    windows = held_out_windows(eval_set, tokenizer, eval_seq_len, eval_windows)
    info = {"calibration": {**{k: str(v) if k == "dataset" else v for k, v in cal.items()}},
            "eval": {"dataset": str(eval_set), "windows": int(windows.shape[0]), "seq_len": eval_seq_len},
            "sample": sample, "candidate_bits": list(bits),
            "measure_at": None if measure_at is None else list(measure_at)}
    with torch.no_grad():
        return measure_report(hf_model, adapter, plan, schemes, ids, windows, model_label=base_name,
                              save_dtype=save_dtype, batch_size=batch_size, sample=sample,
                              measure_layers=measure_layers, measure_linears=measure_linears,
                              measure_at=measure_at, bits=bits,
                              info=info, progress=progress)


def held_out_windows(eval_set, tokenizer, seq_len: int, count: int) -> torch.Tensor:
    """`count` windows of `seq_len` tokens from the second half of each held-out text (`eval_set`: one dataset,
    or several as a list or comma-separated names, e.g. "lee,wiki"), spread evenly over it: the second half, so
    that scoring which reads from the start (`quantkit evaluate`, the allocation bench) checks predictions on
    other text; spread, so that a long text such as the wiki dump is sampled across its articles rather than
    by the one or two its last tokens belong to. A text shorter than `count` windows gives what it has (from
    its end)."""
    from quantkit import data
    from quantkit.scoring import windows_of

    sets = ([x.strip() for x in eval_set.split(",") if x.strip()] if isinstance(eval_set, str) and "," in eval_set
            else list(eval_set) if isinstance(eval_set, (list, tuple)) else [eval_set])
    out = []
    for one in sets:
        stream = data.eval_token_stream(one, tokenizer)
        total = stream.numel()
        tail = max(total // 2, min(count, total // seq_len) * seq_len)  # the second half, or the last windows
        region = stream[total - tail:]
        slots = windows_of(region[region.numel() % seq_len:] if region.numel() >= seq_len else stream, seq_len)
        n = min(count, slots.shape[0])
        out.append(slots[torch.arange(n) * slots.shape[0] // n])  # evenly spaced, the first slot always taken
    return torch.cat(out)


def allocate_plan(model, plan, schemes: dict, *, target_bits=None, target_size=None, sensitivity=None,
                  fixed: Optional[int] = None, trust_remote_code: bool = False, progress: bool = False):
    """`plan` with the budget's mixture as one override per linear (so the run's fingerprint, the
    resume check and the model card see it), the report it came from, and the allocation's record."""
    import re
    from dataclasses import replace

    from quantkit.scheme import Override

    check_format_carries_mixture(plan.format, plan.gguf_type)
    if sensitivity is not None:
        report = read_report(sensitivity)
    elif not isinstance(model, (str, Path)):
        raise QuantkitError("allocating an in-memory model needs its sensitivity report: run `quantkit sensitivity` "
                            "on its folder and pass sensitivity=<report>")
    else:
        say = (lambda s: print(f"sensitivity: {s}", flush=True)) if progress else (lambda s: None)
        # measured at 4 bits (each linear's own group size) only, the other schemes predicted from each
        # linear's own ratio: a quarter of the forwards of measuring every candidate
        report = sensitivity_of_model(str(model), plan, trust_remote_code=trust_remote_code, measure_at=(4,),
                                      progress=say)
    if fixed is not None:
        report = {**report, "fixed_bytes": fixed}
    chosen, allocation = choose_mixture(report, plan, schemes, target_bits=target_bits, target_size=target_size)
    overrides = tuple(Override(pattern=f"^{re.escape(n)}$", bits=s.bits, group_size=s.group_size, sym=s.sym)
                      for n, s in chosen.items() if s != schemes[n])
    return replace(plan, scheme=replace(plan.scheme, overrides=plan.scheme.overrides + overrides)), report, allocation


def record_allocation(output: Path, report: dict[str, Any], allocation: dict[str, Any]) -> None:
    """The report's files and the allocation beside the checkpoint, referenced from its model card."""
    from quantkit.allocation.report import append_card, card_section, write_report

    write_report(output, {**report, "allocation": allocation})
    append_card(output, card_section(report, allocation))
