"""One run configuration: every `quantize` setting declared once, the source of the CLI and the API.

Each `Setting` names the API keyword, its default, its section of `quantize --help`, its help text,
its command-line spelling and the Python types it accepts. `quantkit.cli` builds the `quantize`
options and the grouped help from `SETTINGS`; `quantkit.api.quantize` keeps an explicit, documented
signature whose keywords a test checks against `api_keywords()` (and the CLI's options against
`cli_names()`), so adding a setting touches this table and the code that reads it.

A few settings exist on one side only: the CLI's method-option shortcuts (`--mse` is
`--option mse=true`) and `--json`; the API's in-memory `tokenizer` and `progress` (the CLI derives
it from `--json`). Values are checked here before anything is loaded, one line naming the setting
and the fix (vLLM's EngineArgs works the same way: one dataclass, argparse generated from it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from quantkit.errors import QuantkitError

SOURCE = "Source model"
RECIPE = "Method and scheme"
SHORTCUTS = "Method option shortcuts (same as --option KEY=VALUE)"
BUDGET = "Mixed precision to a size budget"
CALIBRATION = "Calibration data"
EXECUTION = "Execution: devices and memory"
OUTPUT = "Output"
SECTIONS = (SOURCE, RECIPE, SHORTCUTS, BUDGET, CALIBRATION, EXECUTION, OUTPUT)  # `quantize --help` order

_INT, _NUMBER, _STR, _BOOL = (int,), (int, float), (str,), (bool,)


@dataclass(frozen=True)
class Setting:
    """One `quantize` setting. `decls` is the click declaration (flag spellings, then click's parameter
    name when it differs from `name`); empty for an API-only setting. `types`: the Python types an API
    value must have (None is always allowed: not given); empty: anything (checked by its consumer)."""

    name: str
    section: str
    help: str
    default: Any = None
    decls: tuple[str, ...] = ()
    click: dict = field(default_factory=dict)  # extra click.option keywords (type, is_flag, multiple, ...)
    types: tuple[type, ...] = ()
    api: bool = True  # False: a CLI-only setting, folded into another keyword by the CLI

    @property
    def flag(self) -> Optional[str]:
        """The first command-line spelling (`--num-samples`), None for an API-only setting."""
        return self.decls[0].split("/")[0] if self.decls else None

    @property
    def cli_name(self) -> Optional[str]:
        """click's parameter name for this setting (what the CLI function receives)."""
        if not self.decls:
            return None
        plain = [d for d in self.decls if not d.startswith("-")]
        return plain[0] if plain else self.name


def _s(name, section, help, default=None, decls=None, types=(), api=True, **click) -> Setting:
    decls = (f"--{name.replace('_', '-')}",) if decls is None else decls
    return Setting(name, section, help, default, tuple(decls), click, types, api)


SETTINGS: tuple[Setting, ...] = (
    # -- source
    _s("model", SOURCE, "HF folder, hub id, .gguf file, or 'demo' (default: the recipe's source model, else demo).",
       types=()),
    _s("tokenizer", SOURCE, "Tokenizer for an in-memory model (default: its folder's).", decls=()),
    _s("trust_remote_code", SOURCE, "Allow model code from the hub (off by default; never read from a recipe).",
       False, types=_BOOL, is_flag=True),
    # -- recipe or scheme
    _s("method", RECIPE, "rtn, gptq, awq, smoothquant, or transforms then a weight quantizer: awq,gptq "
                         "(default: the recipe's, else rtn)."),
    _s("recipe", RECIPE, "YAML recipe: a path, a bundled name, or a checkpoint's recipe.yaml (repeats that run); "
                         "flags override it.", types=()),
    _s("scheme", RECIPE, "A named scheme instead of --bits/--group-size/--sym: W4A16, W8A16, W8A8, FP8, FP8_DYNAMIC, "
                         "FP8_BLOCK, NVFP4A16, NVFP4, MXFP4A16, MXFP4, MXFP4XFP8, MXFP8A16, MXFP8, W4AFP8 (case-insensitive). Float ones take "
                         "--method rtn (their default; NVFP4 / MXFP4: smoothquant), gptq, smoothquant[,gptq] or "
                         "awq[,gptq].", types=_STR),
    _s("bits", RECIPE, "2, 3, 4 or 8 (default 4).", types=_INT, type=int),
    _s("group_size", RECIPE, "32, 64, 128, -1 (per channel) or auto (default).", types=(int, str)),
    _s("sym", RECIPE, "Symmetric or asymmetric grid (default: the method's usual).", decls=("--sym/--asym",),
       types=_BOOL),
    _s("format", RECIPE, "gptq, compressed-tensors, awq or gguf (default: the method's).", decls=("--format", "format_"),
       types=_STR),
    _s("gguf_type", RECIPE, "With --format gguf: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, Q4_K_M or Q5_K_M "
                            "(default: the type matching --bits/--sym).", types=_STR),
    _s("kv_cache_scheme", RECIPE, "fp8 (one scale per layer) or fp8-head (one per KV head): calibrate static FP8 "
                                  "KV-cache scales on the calibration tokens (keys after RoPE) and write them as vLLM "
                                  "reads them (compressed-tensors only); quantkit's engine uses them with "
                                  "--kv-cache-dtype fp8.", types=_STR),
    _s("ignore", RECIPE, "Regex of module names to keep in full precision (repeatable; default lm_head).",
       types=(list, tuple), multiple=True),
    _s("options", RECIPE, "Method option KEY=VALUE (repeatable), e.g. damp_percent=0.02.", decls=("--option", "options"),
       types=(dict,), multiple=True),
    # -- CLI shortcuts for method options
    _s("desc_act", SHORTCUTS, "GPTQ: act-order, columns by descending Hessian diagonal (default on).",
       decls=("--desc-act/--no-desc-act",), api=False),
    _s("static_groups", SHORTCUTS, "GPTQ: group scales computed up front, keeping act-order's g_idx trivial "
                                   "(default on).", decls=("--static-groups/--no-static-groups",), api=False),
    _s("mse", SHORTCUTS, "GPTQ and RTN: each group's range shrunk to its lowest rounding error (default on).",
       decls=("--mse/--no-mse",), api=False),
    _s("offload_hessians", SHORTCUTS, "GPTQ: keep Hessians in host memory between batches.", api=False, is_flag=True),
    # -- mixed precision
    _s("target_bits", BUDGET, "Mixed precision: average bits per weight of the quantized linears (scales, zero "
                              "points, g_idx counted); a scheme per linear by least predicted KL.", types=_NUMBER,
       type=float),
    _s("target_size", BUDGET, "Mixed precision: size of the written files, e.g. 2.1GB or 700MiB.", types=_STR),
    _s("sensitivity", BUDGET, "With --target-*: the report of `quantkit sensitivity` to allocate from "
                              "(default: measured first).", types=()),
    # -- calibration
    _s("dataset", CALIBRATION, "lee (default) or wiki (both offline), wikitext2, c4, pileval, ultrachat, or a "
                               ".txt/.jsonl/.json/.parquet file (Python: also texts, conversations, token tensors, "
                               "a DataLoader)."),
    _s("num_samples", CALIBRATION, "Calibration sequences (default 128).", types=_INT, type=int),
    _s("seq_len", CALIBRATION, "Tokens per calibration sequence (default 512).", types=_INT, type=int),
    _s("seed", CALIBRATION, "Sampling seed (default 0).", types=_INT, type=int),
    _s("chat_template", CALIBRATION, "Render message datasets with the tokenizer's chat template.", False,
       types=_BOOL, is_flag=True),
    _s("batch_size", CALIBRATION, "Calibration sequences per forward (default: all of them when a layer's forward "
                                  "fits 4 GiB).", types=_INT, type=int),
    _s("moe_calibration", CALIBRATION, "MoE models: calibrate each expert on the tokens routed to it (routed, the "
                                       "default) or on every token (all; the block's output stays the routed one).",
       types=_STR, type=None),
    _s("moe_min_tokens", CALIBRATION, "MoE models, routed: an expert with fewer calibration tokens is quantized "
                                      "with RTN (default 8).", types=_INT, type=int),
    # -- execution
    _s("device", EXECUTION, "Compute device for the layer being calibrated (default cpu).", types=_STR),
    _s("streaming", EXECUTION, "Read decoder layers from disk one at a time (default: when the model would not fit "
                               "comfortably).", decls=("--streaming/--no-streaming",), types=_BOOL),
    _s("device_map", EXECUTION, "auto: place the decoder layers with accelerate's device map (GPUs, host memory, "
                                "then disk, streamed); each layer is calibrated on the GPU that holds it.", types=_STR),
    _s("max_memory", EXECUTION, "With --device-map: budget per device, e.g. 0=70GiB,1=70GiB,cpu=200GiB.",
       types=(str, dict)),
    _s("nproc", EXECUTION, "Calibrate data-parallel on N local processes (2, 4 or 8; gloo on CPU, one GPU each with "
                           "--device cuda); the same bytes as one process. Under torchrun the launched group is used.",
       type=int),
    _s("dist_timeout", EXECUTION, "Seconds a rank waits for the others before the data-parallel run stops "
                                  "(default 600).", types=_NUMBER, type=float),
    # -- output
    _s("output", OUTPUT, "Output folder (default ./<model>-<method>-w<bits>g<group>).", types=()),
    _s("overwrite", OUTPUT, "Replace a non-empty output folder (only once the new one is complete).", False,
       types=_BOOL, is_flag=True),
    _s("resume", OUTPUT, "Continue an interrupted run from its last finished layer.", False, types=_BOOL,
       is_flag=True),
    _s("dtype", OUTPUT, "dtype of unquantized tensors in the output: auto, float32, float16, bfloat16 (default: the "
                        "recipe's, else the source's).", types=_STR),
    _s("max_shard_size", OUTPUT, "Largest safetensors shard, e.g. 5GB (default: the recipe's, else 5GB).",
       types=(str, int)),
    _s("eval_after", OUTPUT, "Score the checkpoint on held-out text (perplexity, KL divergence to the original, "
                             "top-1 agreement) and record it in the model card.", False,
       decls=("--eval", "eval_after"), types=_BOOL, is_flag=True),
    _s("progress", OUTPUT, "Print progress (the CLI: unless --json).", True, decls=(), types=_BOOL),
    _s("as_json", OUTPUT, "Print one JSON object as the last line of stdout.", decls=("--json", "as_json"), api=False,
       is_flag=True),
)
BY_NAME = {s.name: s for s in SETTINGS}
MOE_CHOICES = ("routed", "all")

QUANTIZE_EXAMPLES = (
    "quantkit quantize                                      # the demo model, RTN 4-bit, group auto",
    "quantkit quantize --method gptq --eval                 # GPTQ; KL and perplexity in the model card",
    "quantkit quantize --model ./my-model --recipe best-w4  # a local HF folder, the KL-best 4-bit recipe",
    "quantkit quantize --method awq,gptq --format compressed-tensors",
    "quantkit quantize --scheme nvfp4a16                    # a named scheme (FP4 weights, compressed-tensors)",
    "quantkit quantize --method gptq --format gguf --gguf-type Q4_K_M",
    "quantkit quantize --recipe ./ckpt/recipe.yaml --output ./again   # repeat a run: the same bytes",
    "Every option and the defaults' measurements: docs/cli.md and docs/methods.md",
)


def api_keywords() -> list[str]:
    """The keywords `quantkit.api.quantize` takes, in declaration order."""
    return [s.name for s in SETTINGS if s.api]


def cli_names() -> list[str]:
    """click's parameter names of `quantkit quantize`'s options."""
    return [s.cli_name for s in SETTINGS if s.decls]


def help_sections() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(heading, click parameter names) per section, for quantkit.cli_help.SectionedCommand."""
    return tuple((section, tuple(s.cli_name for s in SETTINGS if s.section == section and s.decls))
                 for section in SECTIONS)


def click_options(command):
    """Decorate a click command with one option per CLI setting, in declaration order."""
    import click

    for s in reversed(SETTINGS):
        if not s.decls:
            continue
        extra = dict(s.click)
        if s.name == "moe_calibration":
            extra["type"] = click.Choice(MOE_CHOICES)
        command = click.option(*s.decls, default=None if extra.get("multiple") else s.default, help=s.help,
                               **extra)(command)
    return command


def check_values(values: dict[str, Any]) -> None:
    """Each given value has a type its setting accepts; else one line naming the setting and what it takes."""
    for name, value in values.items():
        s = BY_NAME.get(name)
        if s is None or value is None or not s.types:
            continue
        ok = isinstance(value, s.types) and not (isinstance(value, bool) and bool not in s.types)
        if not ok:
            words = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
                     tuple: "a list", dict: "a mapping"}
            kinds = " or ".join(dict.fromkeys(words[t] for t in s.types if not (t is int and float in s.types)))
            raise QuantkitError(f"{name} ({s.flag or 'Python only'}) must be {kinds}, got {value!r}; "
                                f"pass {kinds} or leave it out")
