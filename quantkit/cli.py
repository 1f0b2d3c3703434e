"""`quantkit` command line: parse, call the Python API, print (human or --json). No logic of its own.

Errors a user can fix exit with code 2 and one line on stderr, never a traceback.
"""
from __future__ import annotations

import json
import os
import sys

import click

from quantkit.cli_help import SectionedCommand
from quantkit.errors import QuantkitError


def _emit(result: dict, as_json: bool, human: str) -> None:
    if as_json:
        click.echo(json.dumps(result, default=str))
    else:
        click.echo(human)


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    import datasets

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="quantkit")
def cli():
    """quantkit: quantize Hugging Face causal LMs into packed, Hub-ready checkpoints and measure them."""


QUANTIZE_HELP_SECTIONS = (  # `quantize --help` in this order; options not named here go under "Other options"
    ("Model and output", ("model", "output", "overwrite", "resume", "dtype", "max_shard_size", "trust_remote_code",
                          "as_json")),
    ("Method and scheme", ("method", "recipe", "bits", "group_size", "sym", "format_", "gguf_type", "ignore",
                           "options")),
    ("Method option shortcuts (same as --option KEY=VALUE)", ("desc_act", "static_groups", "mse", "offload_hessians")),
    ("Calibration data", ("dataset", "num_samples", "seq_len", "seed", "chat_template", "batch_size")),
    ("Quality", ("eval_after",)),
    ("Devices and memory", ("device", "streaming", "device_map", "max_memory", "nproc", "dist_timeout")),
    ("Mixture-of-Experts models", ("moe_calibration", "moe_min_tokens")),
    ("Mixed precision to a size budget", ("target_bits", "target_size", "sensitivity")),
)
QUANTIZE_EXAMPLES = (
    "quantkit quantize                                      # the demo model, RTN 4-bit, group auto",
    "quantkit quantize --method gptq --eval                 # GPTQ; KL and perplexity in the model card",
    "quantkit quantize --model ./my-model --recipe best-w4  # a local HF folder, the KL-best 4-bit recipe",
    "quantkit quantize --method awq,gptq --format compressed-tensors",
    "quantkit quantize --method gptq --format gguf --gguf-type Q4_K_M",
    "Every option and the defaults' measurements: docs/cli.md and docs/methods.md",
)


@cli.command(cls=SectionedCommand, sections=QUANTIZE_HELP_SECTIONS, examples=QUANTIZE_EXAMPLES)
@click.option("--model", default="demo", show_default=True, help="HF folder, hub id, .gguf file, or 'demo'.")
@click.option("--method", default=None,
              help="rtn, gptq, awq, smoothquant, or transforms then a weight quantizer: awq,gptq "
                   "(default: the recipe's, else rtn).")
@click.option("--bits", type=int, default=None, help="2, 3, 4 or 8 (default 4).")
@click.option("--group-size", default=None, help="32, 64, 128, -1 (per channel) or auto (default).")
@click.option("--sym/--asym", default=None, help="Symmetric or asymmetric grid (default: the method's usual).")
@click.option("--format", "format_", default=None, help="gptq, compressed-tensors, awq or gguf (default: the method's).")
@click.option("--gguf-type", default=None, help="With --format gguf: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, "
              "Q4_K_M or Q5_K_M (default: the type matching --bits/--sym).")
@click.option("--recipe", default=None, help="YAML recipe (path or bundled name); flags override it.")
@click.option("--dataset", default=None, help="lee (default) or wiki (both offline), wikitext2, c4, pileval, ultrachat, or a .txt/.jsonl/.json/.parquet file.")
@click.option("--num-samples", type=int, default=None, help="Calibration sequences (default 128).")
@click.option("--seq-len", type=int, default=None, help="Tokens per calibration sequence (default 512).")
@click.option("--seed", type=int, default=None, help="Sampling seed (default 0).")
@click.option("--chat-template", is_flag=True, help="Render message datasets with the tokenizer's chat template.")
@click.option("--ignore", multiple=True, help="Regex of module names to keep in full precision (repeatable; default lm_head).")
@click.option("--option", "options", multiple=True, help="Method option KEY=VALUE (repeatable), e.g. damp_percent=0.02.")
@click.option("--output", default=None, help="Output folder (default ./<model>-<method>-w<bits>g<group>).")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output folder (only once the new one is complete).")
@click.option("--dtype", default="auto", show_default=True, help="dtype of unquantized tensors in the output.")
@click.option("--device", default=None, help="Compute device for the layer being calibrated (default cpu).")
@click.option("--trust-remote-code", is_flag=True, help="Allow model code from the hub (off by default).")
@click.option("--max-shard-size", default="5GB", show_default=True)
@click.option("--batch-size", type=int, default=None,
              help="Calibration sequences per forward (default: all of them when a layer's forward fits 4 GiB).")
@click.option("--eval", "eval_after", is_flag=True, help="Score the checkpoint on held-out text (perplexity, KL divergence to the original, "
                   "top-1 agreement) and record it in the model card.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its last finished layer.")
@click.option("--streaming/--no-streaming", default=None,
              help="Read decoder layers from disk one at a time (default: when the model would not fit comfortably).")
@click.option("--offload-hessians", is_flag=True, help="GPTQ: keep Hessians in host memory between batches.")
@click.option("--desc-act/--no-desc-act", default=None,
              help="GPTQ: act-order, columns by descending Hessian diagonal (default on).")
@click.option("--static-groups/--no-static-groups", default=None,
              help="GPTQ: group scales computed up front, keeping act-order's g_idx trivial (default on).")
@click.option("--mse/--no-mse", default=None,
              help="GPTQ and RTN: each group's range shrunk to its lowest rounding error (default on).")
@click.option("--moe-calibration", type=click.Choice(["routed", "all"]), default=None,
              help="MoE models: calibrate each expert on the tokens routed to it (routed, the default) or on every "
                   "token (all; the block's output stays the routed one).")
@click.option("--moe-min-tokens", type=int, default=None,
              help="MoE models, routed: an expert with fewer calibration tokens is quantized with RTN (default 8).")
@click.option("--nproc", type=int, default=None,
              help="Calibrate data-parallel on N local processes (2, 4 or 8; gloo on CPU, one GPU each with --device cuda); "
                   "the same bytes as one process. Under torchrun the launched group is used.")
@click.option("--dist-timeout", type=float, default=None,
              help="Seconds a rank waits for the others before the data-parallel run stops (default 600).")
@click.option("--device-map", default=None, help="auto: place the decoder layers with accelerate's device map (GPUs, "
              "host memory, then disk, streamed); each layer is calibrated on the GPU that holds it.")
@click.option("--max-memory", default=None, help="With --device-map: budget per device, e.g. 0=70GiB,1=70GiB,cpu=200GiB.")
@click.option("--target-bits", type=float, default=None, help="Mixed precision: average bits per weight of the quantized "
              "linears (scales, zero points, g_idx counted); a scheme per linear by least predicted KL.")
@click.option("--target-size", default=None, help="Mixed precision: size of the written files, e.g. 2.1GB or 700MiB.")
@click.option("--sensitivity", "sensitivity", default=None,
              help="With --target-*: the report of `quantkit sensitivity` to allocate from (default: measured first).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object as the last line of stdout.")
def quantize(model, method, bits, group_size, sym, format_, gguf_type, recipe, dataset, num_samples, seq_len, seed, chat_template,
             ignore, options, output, overwrite, dtype, device, trust_remote_code, max_shard_size, batch_size, eval_after,
             resume, streaming, offload_hessians, desc_act, static_groups, mse, moe_calibration, moe_min_tokens, nproc,
             dist_timeout, device_map, max_memory, target_bits, target_size, sensitivity, as_json):
    """Quantize a model and write a packed checkpoint."""
    from quantkit import api

    _quiet_libraries()
    result = api.quantize(
        model=model, method=method, bits=bits, group_size=group_size, sym=sym, format=format_, recipe=recipe,
        dataset=dataset, num_samples=num_samples, seq_len=seq_len, seed=seed, chat_template=chat_template,
        ignore=list(ignore) if ignore else None, options=_method_options(options, offload_hessians=offload_hessians,
                                                                               desc_act=desc_act, static_groups=static_groups,
                                                                               mse=mse), output=output,
        overwrite=overwrite, dtype=dtype, device=device, trust_remote_code=trust_remote_code, max_shard_size=max_shard_size,
        batch_size=batch_size, eval_after=eval_after, progress=not as_json, resume=resume, streaming=streaming,
        gguf_type=gguf_type, moe_calibration=moe_calibration, moe_min_tokens=moe_min_tokens, nproc=nproc,
        dist_timeout=dist_timeout, device_map=device_map, max_memory=max_memory,
        target_bits=target_bits, target_size=target_size, sensitivity=sensitivity,
    )
    if result is None:  # a rank other than 0 of a torchrun group: rank 0 reports
        return
    rss = result["peak_rss_mb"]
    _emit(dict(result), as_json, f"wrote {result['output']} ({result['method']}, {result['bits']}-bit, group {result['group_size']}, "
                           f"{result['format']}) in {result['seconds']:.1f} s, "
                           + (f"peak RSS {rss:.0f} MB" if rss is not None else "peak RSS unknown"))


@cli.command()
@click.argument("src", required=False)
@click.option("--model", "model", default=None, help="Checkpoint folder to convert (or give it as the argument).")
@click.option("--format", "format_", required=True, help="gptq, awq, compressed-tensors or gguf.")
@click.option("--output", required=True, help="Destination folder (written in a staging folder, renamed at the end).")
@click.option("--gguf-type", default=None, help="With --format gguf: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 for a quantized "
              "source (default: its grid's), F16, BF16 or F32.")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output folder (only once the new one is complete).")
@click.option("--json", "as_json", is_flag=True)
def convert(src, model, format_, output, gguf_type, overwrite, as_json):
    """Re-pack a checkpoint into another layout, losslessly, or refuse saying what would be lost."""
    from quantkit.convert import convert as run

    _quiet_libraries()
    r = run(_one_model(src, model), format_, output, gguf_type=gguf_type, overwrite=overwrite)
    _emit(r, as_json, f"wrote {r['output']} ({r['format']}{' ' + r['gguf_type'] if r.get('gguf_type') else ''}, "
                      f"{r['quantized_linears']} quantized linears carried over exactly)")


@cli.command("eval")
@click.option("--model", required=True, help="Quantized checkpoint folder, HF folder, or 'demo'.")
@click.option("--baseline", default=None, help="Model to compare against on the same tokens (e.g. demo).")
@click.option("--dataset", default="lee", show_default=True)
@click.option("--seq-len", type=int, default=512, show_default=True)
@click.option("--max-windows", type=int, default=None, help="Score at most this many windows.")
@click.option("--backend", default="auto", show_default=True, help="auto, reference, cpu or triton.")
@click.option("--dtype", default=None, help="Activation dtype (default: the checkpoint's).")
@click.option("--device", default=None)
@click.option("--batch-size", type=int, default=4, show_default=True)
@click.option("--engine", is_flag=True, help="Score through the paged-KV engine (the code path `bench` times).")
@click.option("--baseline-cache/--no-baseline-cache", default=True, show_default=True,
              help="Keep the baseline's side of the KL comparison on disk for the next eval.")
@click.option("--json", "as_json", is_flag=True)
def eval_cmd(model, baseline, dataset, seq_len, max_windows, backend, dtype, device, batch_size, engine, baseline_cache,
             as_json):
    """Held-out perplexity; with --baseline, also KL divergence to it and top-1 agreement."""
    from quantkit import api

    _quiet_libraries()
    r = api.evaluate(model, baseline=baseline, dataset=dataset, seq_len=seq_len, max_windows=max_windows, backend=backend,
                     dtype=dtype, device=device, batch_size=batch_size, progress=not as_json, engine=engine,
                     baseline_cache=baseline_cache)
    human = f"perplexity {r['perplexity']:.4f} over {r['tokens']} tokens ({r['windows']} windows)"
    if r.get("baseline_perplexity"):
        human += (f"; baseline {r['baseline_perplexity']:.4f}; ratio {r['ratio']:.4f}"
                  f"{_stderr(r['ln_ppl_ratio_stderr'], 'ln ratio')}\n"
                  f"KL divergence to the baseline: mean {r['kl_mean']:.5f}{_stderr(r['kl_mean_stderr'])}, "
                  f"p99 {r['kl_p99']:.5f}; top-1 agreement {100 * r['top1_agreement']:.2f} %")
    _emit(r, as_json, human)


def _stderr(value, of: str = "") -> str:
    """' (+-x, standard error over windows)' for the human eval line; nothing with a single window."""
    return "" if value is None else f" (±{value:.5f}{' in ' + of if of else ''}, standard error over windows)"


def _speculative_options(command):
    """--draft, --num-speculative-tokens, --draft-dtype and the LM-head options, shared by generate and bench."""
    for option in reversed([
        click.option("--draft", default=None,
                     help="Speculative decoding: a draft model with the target's tokenizer (quantized checkpoint, "
                          "smaller HF folder, demo) or 'ngram' (prompt lookup, no model)."),
        click.option("--num-speculative-tokens", type=click.IntRange(min=1), default=4, show_default=True,
                     help="Draft tokens verified per step (with --draft)."),
        click.option("--draft-dtype", default=None, help="Activation dtype of the draft model (default: its own)."),
        click.option("--lm-head-quant", type=click.Choice(["int8", "int4", "shortlist"]), default=None,
                     help="Decode through an RTN copy of the LM head only (the embedding is untouched; changes "
                          "logits); shortlist: the int4 copy picks 64 candidates, the full head scores them."),
        click.option("--draft-lm-head-quant", type=click.Choice(["int8", "int4", "shortlist"]), default=None,
                     help="The same for the draft model (a cheaper draft step)."),
        click.option("--draft-confidence", type=float, default=0.0, show_default=True,
                     help="A draft model stops drafting for a sequence once its latest token's probability "
                          "is below this (dynamic draft length; 0: always --num-speculative-tokens)."),
    ]):
        command = option(command)
    return command


@cli.command()
@click.option("--model", default="demo", show_default=True, help="Quantized checkpoint, HF folder, or 'demo'.")
@click.option("--prompt", required=True)
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--chat", is_flag=True, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 means greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--backend", default="auto", show_default=True)
@click.option("--kv-cache-dtype", default="auto", show_default=True, help="auto (model dtype), int8 or fp8.")
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--dtype", default=None)
@click.option("--device", default=None)
@_speculative_options
@click.option("--json", "as_json", is_flag=True)
def generate(model, prompt, max_new_tokens, chat, temperature, top_p, top_k, seed, backend, kv_cache_dtype, block_size,
             dtype, device, draft, num_speculative_tokens, draft_dtype, lm_head_quant, draft_lm_head_quant, draft_confidence,
             as_json):
    """Generate text through the paged-KV engine, streaming tokens as they come."""
    from quantkit.engine.api import generate_text

    _quiet_libraries()
    stream = None if as_json else (lambda piece: click.echo(piece, nl=False))
    r = generate_text(model, prompt, max_new_tokens=max_new_tokens, chat=chat, temperature=temperature, top_p=top_p,
                      top_k=top_k, seed=seed, stream=stream, backend=backend, kv_cache_dtype=kv_cache_dtype,
                      block_size=block_size, dtype=dtype, device=device, draft=draft,
                      num_speculative_tokens=num_speculative_tokens, draft_dtype=draft_dtype, lm_head_quant=lm_head_quant,
                      draft_lm_head_quant=draft_lm_head_quant, draft_confidence=draft_confidence)
    if as_json:
        click.echo(json.dumps(r, default=str))
    else:
        click.echo("")


@cli.command()
@click.option("--model", default="demo", show_default=True, help="Quantized checkpoint, HF folder, or 'demo'.")
@click.option("--batch-size", "batch", type=int, default=8, show_default=True,
              help="Prompts run together (continuous batching), as --batch-size counts sequences everywhere.")
@click.option("--input-len", type=int, default=128, show_default=True)
@click.option("--output-len", type=int, default=128, show_default=True)
@click.option("--kv-cache-dtype", default="auto", show_default=True, help="auto (model dtype), int8 or fp8.")
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--kv-cache-memory", default=None, help="KV pool size in bytes (default: a fraction of free memory).")
@click.option("--backend", default="auto", show_default=True)
@click.option("--dtype", default=None)
@click.option("--device", default=None)
@_speculative_options
@click.option("--json", "as_json", is_flag=True)
def bench(model, batch, input_len, output_len, kv_cache_dtype, block_size, kv_cache_memory, backend, dtype, device, draft,
          num_speculative_tokens, draft_dtype, lm_head_quant, draft_lm_head_quant, draft_confidence, as_json):
    """TTFT, TPOT, tokens/s and KV-cache use of a batch run with continuous batching."""
    from quantkit.engine.api import run_bench

    _quiet_libraries()
    memory = int(kv_cache_memory) if kv_cache_memory is not None and str(kv_cache_memory).isdigit() else kv_cache_memory
    r = run_bench(model, batch=batch, input_len=input_len, output_len=output_len, kv_cache_dtype=kv_cache_dtype,
                  block_size=block_size, kv_cache_memory=memory, backend=backend, device=device, dtype=dtype,
                  draft=draft, num_speculative_tokens=num_speculative_tokens, draft_dtype=draft_dtype,
                  lm_head_quant=lm_head_quant, draft_lm_head_quant=draft_lm_head_quant,
                  draft_confidence=draft_confidence)
    human = (f"ttft {r['ttft_ms']:.1f} ms, tpot {r['tpot_ms']:.1f} ms, {r['tokens_per_s']:.1f} tokens/s; "
             f"KV blocks {r['kv_blocks_used']}/{r['kv_blocks_total']} ({r['kv_bytes_per_block']} B each), "
             f"prefix hit rate {r['prefix_hit_rate']:.2f}")
    if r.get("acceptance_rate") is not None:
        human += f"; draft acceptance {r['acceptance_rate']:.2f}, {r['mean_accepted_tokens']:.2f} accepted per step"
    _emit(r, as_json, human)


@cli.command()
@click.argument("path", required=False)
@click.option("--model", "model", default=None, help="Checkpoint folder to inspect (or give it as the argument).")
@click.option("--json", "as_json", is_flag=True)
def inspect(path, model, as_json):
    """Scheme, per-layer bits and groups, and size on disk against the original."""
    from quantkit.inspect import inspect_checkpoint

    r = inspect_checkpoint(_one_model(path, model))
    lines = [f"{r['path']}: {r['quant_method']} ({r['format']}), {r['quantized_linears']} quantized linears",
             f"size on disk {r['size_mb']:.1f} MB; unquantized equivalent {r['original_size_mb']:.1f} MB "
             f"({r['compression']:.2f}x smaller)"]
    for name, info in r["layers"].items():
        lines.append(f"  {name}: {info['bits']}-bit, group {info['group_size']}, {'sym' if info['sym'] else 'asym'}, "
                     f"{info['shape'][0]}x{info['shape'][1]}")
    lines += _moe_lines(r.get("moe"))
    _emit(r, as_json, "\n".join(lines))


def _moe_lines(moe) -> list[str]:
    """inspect's view of a MoE checkpoint's calibration: tokens per expert, experts left uncalibrated."""
    if not moe:
        return []
    lines = [f"experts calibrated: {moe['calibration']}"
             + (f" (fewer than {moe['min_tokens']} tokens: {moe['uncalibrated_method']})" if "min_tokens" in moe else "")]
    for name, r in (moe.get("layers") or {}).items():
        left = ", ".join(r["uncalibrated"]) or "none"
        lines.append(f"  {name}: {r['num_experts']} experts, tokens min/median/max {r['tokens_min']}/"
                     f"{r['tokens_median']}/{r['tokens_max']}; uncalibrated: {left}")
    return lines


_ON_OFF_FLAGS = ("desc_act", "static_groups", "mse")  # --x/--no-x pairs: None when neither was given


def _one_model(positional, option) -> str:
    """The model a command works on: `--model PATH` (as every command takes it) or the argument."""
    if positional is not None and option is not None and positional != option:
        raise QuantkitError(f"two models given ({positional!r} and --model {option!r}); give one")
    if positional is None and option is None:
        raise QuantkitError("no model given; pass --model PATH")
    return option if option is not None else positional


def _method_options(pairs, **flags) -> dict:
    """--option KEY=VALUE pairs plus the convenience flags that were given."""
    options = _parse_options(pairs)
    options.update({k: bool(v) for k, v in flags.items() if v is not None and (v or k in _ON_OFF_FLAGS)})
    return options


def _parse_options(pairs) -> dict:
    from quantkit.plan import parse_option_value

    out = {}
    for pair in pairs or ():
        if "=" not in pair:
            raise QuantkitError(f"--option {pair!r} must look like KEY=VALUE")
        key, value = pair.split("=", 1)
        out[key.strip()] = parse_option_value(value.strip())
    return out


@cli.command()
@click.option("--model", default="demo", show_default=True, help="HF folder, hub id, or 'demo'.")
@click.option("--method", default="gptq", show_default=True, help="The weight quantizer whose errors are measured.")
@click.option("--format", "format_", default=None, help="gptq or compressed-tensors: whose packed sizes are counted.")
@click.option("--group-size", default=None, help="Group size of every candidate (default auto).")
@click.option("--sym/--asym", default=None, help="Symmetric or asymmetric grid (default: the method's usual).")
@click.option("--candidate-bits", default="2,3,4,8", show_default=True, help="Bit widths measured per linear.")
@click.option("--dataset", default=None, help="Calibration text for the proxy's Hessians (default lee).")
@click.option("--num-samples", type=int, default=None, help="Calibration sequences (default 128).")
@click.option("--seq-len", type=int, default=None, help="Tokens per calibration sequence (default 512).")
@click.option("--eval-dataset", default=None, help="Held-out text KL is measured on (default: the calibration dataset's).")
@click.option("--eval-windows", type=int, default=8, show_default=True, help="Held-out windows per KL measurement.")
@click.option("--eval-seq-len", type=int, default=512, show_default=True)
@click.option("--sample", type=int, default=8, show_default=True,
              help="Single linears whose KL is measured at every scheme, to check the proxy.")
@click.option("--measure-layers/--no-measure-layers", default=True, show_default=True,
              help="Measure every decoder layer's KL per scheme (calibrates the proxy per layer).")
@click.option("--output", default=None, help="Report folder (default ./<model>-sensitivity).")
@click.option("--overwrite", is_flag=True)
@click.option("--trust-remote-code", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
def sensitivity(model, method, format_, group_size, sym, candidate_bits, dataset, num_samples, seq_len, eval_dataset,
                eval_windows, eval_seq_len, sample, measure_layers, output, overwrite, trust_remote_code, as_json):
    """KL increase per linear and decoder layer at each candidate scheme: JSON, PNG and HTML report."""
    from quantkit import api

    _quiet_libraries()
    try:
        bits = tuple(int(b) for b in candidate_bits.split(","))
    except ValueError:
        raise QuantkitError(f"--candidate-bits {candidate_bits!r}: give bit widths separated by commas, e.g. 2,3,4,8") from None
    r = api.sensitivity(model, method, group_size=group_size, sym=sym, format=format_, dataset=dataset,
                        num_samples=num_samples, seq_len=seq_len, eval_dataset=eval_dataset, eval_windows=eval_windows,
                        eval_seq_len=eval_seq_len, sample=sample, measure_layers=measure_layers,
                        candidate_bits=bits, output=output, overwrite=overwrite, trust_remote_code=trust_remote_code,
                        progress=not as_json)
    _emit(r, as_json, f"wrote {r['output']} ({r['rows']} rows: {r['linears']} linears x {len(r['schemes'])} schemes; "
                      f"proxy check {json.dumps(r['proxy_check'])})")


def main(argv=None) -> int:
    """Console entry point: maps user errors to exit code 2 and one stderr line."""
    try:
        cli.main(args=argv, standalone_mode=False, prog_name="quantkit")
    except QuantkitError as exc:
        click.echo(f"error: {exc}", err=True)
        return _exit(getattr(exc, "exit_code", 2))
    except click.exceptions.Abort:
        click.echo("error: interrupted", err=True)
        return _exit(130)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        return _exit(2)
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        return _exit(130)
    return _exit(0)


def _exit(code: int) -> int:
    sys.stdout.flush()
    if "torch.distributed" in sys.modules:  # a torchrun rank may still hold its process group
        from quantkit.pipeline.distributed import exit_process

        exit_process(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
