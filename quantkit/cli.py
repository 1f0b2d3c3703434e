"""`quantkit` command line: parse, call the Python API, print (human or --json). No logic of its own.

Errors a user can fix exit with code 2 and one line on stderr, never a traceback.
"""
from __future__ import annotations

import json
import os
import sys

import click

from quantkit import run_config
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


QUANTIZE_HELP_SECTIONS = run_config.help_sections()  # generated from quantkit.run_config.SETTINGS
QUANTIZE_EXAMPLES = run_config.QUANTIZE_EXAMPLES


@cli.command(cls=SectionedCommand, sections=QUANTIZE_HELP_SECTIONS, examples=QUANTIZE_EXAMPLES)
@run_config.click_options
def quantize(**params):
    """Quantize a model and write a packed checkpoint."""
    from quantkit import api

    _quiet_libraries()
    result = api.quantize(**_api_keywords(params))
    if result is None:  # a rank other than 0 of a torchrun group: rank 0 reports
        return
    _emit(dict(result), params["as_json"], _quantize_line(result))


def _quantize_line(r) -> str:
    """quantize's human summary: what was written, with which scheme, how long it took."""
    scheme = r["scheme"] if "scheme" in r else f"{r['bits']}-bit, group {r['group_size']}"
    rss = r["peak_rss_mb"]
    return (f"wrote {r['output']} ({r['method']}, {scheme}, {r['format']}) in {r['seconds']:.1f} s, "
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


KV_CACHE_DTYPE_HELP = ("auto (model dtype), int8 or fp8 (per-token-head dynamic scales; on a checkpoint written with "
                       "quantize --kv-cache-scheme, fp8 uses its calibrated static scales, as vLLM does).")


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
@click.option("--kv-cache-dtype", default="auto", show_default=True, help=KV_CACHE_DTYPE_HELP)
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--dtype", default=None)
@click.option("--device", default=None)
@_speculative_options
@click.option("--cuda-graph/--no-cuda-graph", default=None,
              help="Decode steps replayed from CUDA graphs (default off: not yet checked on a GPU; engine.static_step).")
@click.option("--json", "as_json", is_flag=True)
def generate(model, prompt, max_new_tokens, chat, temperature, top_p, top_k, seed, backend, kv_cache_dtype, block_size,
             dtype, device, draft, num_speculative_tokens, draft_dtype, lm_head_quant, draft_lm_head_quant, draft_confidence,
             cuda_graph, as_json):
    """Generate text through the paged-KV engine, streaming tokens as they come."""
    from quantkit.engine.api import generate_text

    _quiet_libraries()
    stream = None if as_json else (lambda piece: click.echo(piece, nl=False))
    r = generate_text(model, prompt, max_new_tokens=max_new_tokens, chat=chat, temperature=temperature, top_p=top_p,
                      top_k=top_k, seed=seed, stream=stream, backend=backend, kv_cache_dtype=kv_cache_dtype,
                      block_size=block_size, dtype=dtype, device=device, draft=draft,
                      num_speculative_tokens=num_speculative_tokens, draft_dtype=draft_dtype, lm_head_quant=lm_head_quant,
                      draft_lm_head_quant=draft_lm_head_quant, draft_confidence=draft_confidence, cuda_graph=cuda_graph)
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
@click.option("--kv-cache-dtype", default="auto", show_default=True, help=KV_CACHE_DTYPE_HELP)
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--kv-cache-memory", default=None, help="KV pool size in bytes (default: a fraction of free memory).")
@click.option("--backend", default="auto", show_default=True)
@click.option("--dtype", default=None)
@click.option("--device", default=None)
@_speculative_options
@click.option("--cuda-graph/--no-cuda-graph", default=None,
              help="Decode steps replayed from CUDA graphs (default off: not yet checked on a GPU; engine.static_step).")
@click.option("--json", "as_json", is_flag=True)
def bench(model, batch, input_len, output_len, kv_cache_dtype, block_size, kv_cache_memory, backend, dtype, device, draft,
          num_speculative_tokens, draft_dtype, lm_head_quant, draft_lm_head_quant, draft_confidence, cuda_graph, as_json):
    """TTFT, TPOT, tokens/s and KV-cache use of a batch run with continuous batching."""
    from quantkit.engine.api import run_bench

    _quiet_libraries()
    memory = int(kv_cache_memory) if kv_cache_memory is not None and str(kv_cache_memory).isdigit() else kv_cache_memory
    r = run_bench(model, batch=batch, input_len=input_len, output_len=output_len, kv_cache_dtype=kv_cache_dtype,
                  block_size=block_size, kv_cache_memory=memory, backend=backend, device=device, dtype=dtype,
                  draft=draft, num_speculative_tokens=num_speculative_tokens, draft_dtype=draft_dtype,
                  lm_head_quant=lm_head_quant, draft_lm_head_quant=draft_lm_head_quant,
                  draft_confidence=draft_confidence, cuda_graph=cuda_graph)
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


def _api_keywords(params: dict) -> dict:
    """`quantize`'s click parameters -> api.quantize's keywords: the method-option shortcuts fold into
    `options`, --json turns progress off, repeatable options become lists (None when not given)."""
    p = dict(params)
    shortcuts = {k: p.pop(k) for k in ("offload_hessians", *_ON_OFF_FLAGS)}
    as_json = p.pop("as_json")
    p["format"] = p.pop("format_")
    p["ignore"] = list(p["ignore"]) if p["ignore"] else None
    p["options"] = _method_options(p["options"], **shortcuts)
    return {**p, "progress": not as_json}


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
@click.option("--candidate-bits", default="2,3,4,8", show_default=True,
              help="Candidates per linear: bit widths (at --group-size) or scheme labels, e.g. w3g64,w4g128,w4g32,w8g128.")
@click.option("--dataset", default=None, help="Calibration text for the proxy's Hessians (default lee).")
@click.option("--num-samples", type=int, default=None, help="Calibration sequences (default 128).")
@click.option("--seq-len", type=int, default=None, help="Tokens per calibration sequence (default 512).")
@click.option("--eval-dataset", default=None, help="Held-out text KL is measured on (default: the calibration dataset's).")
@click.option("--eval-windows", type=int, default=8, show_default=True, help="Held-out windows per KL measurement.")
@click.option("--eval-seq-len", type=int, default=512, show_default=True)
@click.option("--sample", type=int, default=8, show_default=True,
              help="Single linears whose KL is measured at every scheme, to check the proxy.")
@click.option("--measure-layers/--no-measure-layers", default=True, show_default=True,
              help="Without --measure-linears: measure every decoder layer's KL per scheme (calibrates the proxy per layer).")
@click.option("--measure-linears/--no-measure-linears", default=True, show_default=True,
              help="Measure every linear alone at every candidate (the prediction is the measurement; the costliest, "
                   "the most accurate); --no-measure-linears: predict from the proxy.")
@click.option("--measure-at", default=None,
              help="With --measure-linears: measure each linear at these candidates only (e.g. w4g64) and predict the "
                   "others from its own KL per unit of proxy (default: all candidates).")
@click.option("--output", default=None, help="Report folder (default ./<model>-sensitivity).")
@click.option("--overwrite", is_flag=True)
@click.option("--trust-remote-code", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
def sensitivity(model, method, format_, group_size, sym, candidate_bits, dataset, num_samples, seq_len, eval_dataset,
                eval_windows, eval_seq_len, sample, measure_layers, measure_linears, measure_at, output, overwrite,
                trust_remote_code, as_json):
    """KL increase per linear and decoder layer at each candidate scheme: JSON, PNG and HTML report."""
    from quantkit import api

    _quiet_libraries()
    try:
        bits = tuple(int(b) if b.strip().isdigit() else b.strip() for b in candidate_bits.split(","))
    except ValueError:
        raise QuantkitError(f"--candidate-bits {candidate_bits!r}: give bit widths or scheme labels separated by commas, "
                            "e.g. 2,3,4,8 or w3g64,w4g128,w8g128") from None
    r = api.sensitivity(model, method, group_size=group_size, sym=sym, format=format_, dataset=dataset,
                        num_samples=num_samples, seq_len=seq_len, eval_dataset=eval_dataset, eval_windows=eval_windows,
                        eval_seq_len=eval_seq_len, sample=sample, measure_layers=measure_layers,
                        measure_linears=measure_linears, candidate_bits=bits,
                        measure_at=None if measure_at is None else tuple(
                            int(b) if b.strip().isdigit() else b.strip() for b in measure_at.split(",")), output=output, overwrite=overwrite, trust_remote_code=trust_remote_code,
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
