"""A quantize run, resolved and frozen before any model is loaded: recipe file + flags -> `QuantizePlan`.

Every input is either used or refused here with one line naming the problem and the fix: unknown
recipe keys or calibration keys, options no step of the method declares, calibration flags given to
a method that reads no data, scheme choices the method or the format cannot produce. What the plan
says is what the run does and what the model card records.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

from quantkit.errors import QuantkitError, first_line
from quantkit.quantizers.recipe import Recipe, build_recipe
from quantkit.run_recipe import OUTPUT_KEYS, RESOLVED_KEYS, SOURCE_KEYS, TOKEN_KEYS, Replay, replay_of
from quantkit.scheme import QuantScheme, parse_group_size, scheme_from_dict
from quantkit.scheme_presets import SchemePreset

# a checkpoint's recipe.yaml (quantkit.run_recipe) adds quantkit, source, gguf_type, output and resolved
RECIPE_KEYS = {"method", "format", "scheme", "options", "calibration", "quantkit", "source", "gguf_type", "output",
               "resolved", "kv_cache_scheme"}
CALIBRATION_KEYS = {"dataset", "num_samples", "seq_len", "seed", "chat_template", "batch_size", "moe_calibration",
                    "moe_min_tokens"}
CALIBRATION_DEFAULTS = {"dataset": "lee", "num_samples": 128, "seq_len": 512, "seed": 0, "chat_template": False,
                        "batch_size": None, "moe_calibration": None, "moe_min_tokens": None}
DEFAULT_METHOD = "rtn"


@dataclass(frozen=True)
class Calibration:
    """The calibration set: which text, how many windows of how many tokens, and how it is batched."""

    dataset: Any  # a registry name, a file path, or in-memory data (see quantkit.data)
    num_samples: int
    seq_len: int
    seed: int
    chat_template: bool
    batch_size: Optional[int]  # None: chosen from the model's config (quantkit.pipeline.batching)
    # Mixture-of-Experts models: how experts are calibrated (quantkit.pipeline.experts); None: the default
    moe_calibration: Optional[str] = None
    moe_min_tokens: Optional[int] = None
    explicit: frozenset = frozenset()  # the keys the caller or the recipe set (the rest are defaults)
    # after the tokens are drawn (with_tokens): what they came from and their SHA-256, for the card
    source: Optional[str] = None
    tokens_sha256: Optional[str] = None

    def given(self, key: str):
        """The setting when the caller or the recipe chose it, else None (token rows then size themselves)."""
        return getattr(self, key) if key in self.explicit else None

    def with_tokens(self, tokens) -> "Calibration":
        """These settings as run on `tokens` (quantkit.calibration_sources.CalibrationTokens): their real
        shape, description and hash, which the model card records."""
        n, t = tokens.input_ids.shape
        return replace(self, num_samples=int(n), seq_len=int(t), source=tokens.source, tokens_sha256=tokens.sha256)

    def expert_policy(self):
        """The MoE calibration policy these settings ask for (defaults where not given)."""
        from quantkit.pipeline.experts import ExpertPolicy

        given = {k: v for k, v in (("mode", self.moe_calibration), ("min_tokens", self.moe_min_tokens)) if v is not None}
        return ExpertPolicy(**given)

    def moe_given(self) -> bool:
        return self.moe_calibration is not None or self.moe_min_tokens is not None

    def label(self) -> str:
        d = self.dataset
        if isinstance(d, (str, Path)):
            return str(d)
        return self.source or f"<{type(d).__name__}>"


@dataclass(frozen=True)
class QuantizePlan:
    recipe: Recipe
    scheme: QuantScheme
    format: str
    calibration: Optional[Calibration]  # None: the method reads no data
    gguf_type: Optional[str] = None  # with format "gguf": the llama.cpp type or mix the weights go onto
    preset: Optional[SchemePreset] = None  # --scheme NAME; a float one is written by quantkit.float_checkpoint
    replay: Optional[Replay] = None  # what a checkpoint's recipe.yaml promises (checked after loading)
    kv_cache: Any = None  # --kv-cache-scheme: a quantkit.kv_calibration.KVCacheScheme, None when not asked

    @property
    def float_preset(self) -> Optional[SchemePreset]:
        """The named float scheme this run writes (FP8 / NVFP4 / MXFP4 / W4AFP8), None for the integer path."""
        return self.preset if self.preset is not None and self.preset.float_grid else None

    def method_info(self) -> dict[str, Any]:
        """What the model card and the resume fingerprint record of the method: nothing it did not use."""
        info = self.recipe.describe()
        c = self.calibration
        if c is not None:
            info.update({"calibration": c.label(), "num_samples": c.num_samples, "seq_len": c.seq_len, "seed": c.seed,
                         **({"chat_template": True} if c.chat_template else {}),
                         **({"calibration_tokens_sha256": c.tokens_sha256} if c.tokens_sha256 else {}),
                         **{k: v for k, v in (("moe_calibration", c.moe_calibration),
                                              ("moe_min_tokens", c.moe_min_tokens)) if v is not None}})
        return info


def read_recipe_file(path_or_name: Union[str, Path]) -> dict[str, Any]:
    """Read a YAML recipe: a path, or the name of one bundled in configs/ (e.g. `gptq-w4g128`)."""
    import yaml

    path = Path(path_or_name)
    if not path.exists():
        from importlib.resources import files

        bundled = files("quantkit.recipes") / f"{path_or_name}.yaml"
        if not bundled.is_file():
            raise QuantkitError(f"recipe {str(path_or_name)!r} not found; give a YAML file path or a bundled name")
        text, source = bundled.read_text(), str(path_or_name)
    else:
        try:
            text, source = path.read_text(), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise QuantkitError(f"cannot read recipe {path} ({first_line(exc)}); give a YAML file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise QuantkitError(f"recipe {source} is not valid YAML ({first_line(exc)}); fix the file") from None
    if data is None:
        raise QuantkitError(f"recipe {source} is empty; give at least its method, e.g. `method: gptq`")
    if not isinstance(data, dict):
        raise QuantkitError(f"recipe {source} must be a mapping with keys {sorted(RECIPE_KEYS)}")
    _refuse_unknown(data, RECIPE_KEYS, f"recipe {source}")
    for section in ("options", "calibration", "source", "output", "resolved"):
        if data.get(section) is not None and not isinstance(data[section], dict):
            raise QuantkitError(f"recipe {source}: '{section}' must be a mapping")
    if data.get("scheme") is not None and not isinstance(data["scheme"], (dict, str)):
        raise QuantkitError(f"recipe {source}: 'scheme' must be a mapping (bits, group_size, ...) or a scheme name")
    for section, keys in (("calibration", CALIBRATION_KEYS | TOKEN_KEYS), ("source", SOURCE_KEYS),
                          ("output", OUTPUT_KEYS), ("resolved", RESOLVED_KEYS)):
        _refuse_unknown(data.get(section) or {}, keys, f"recipe {source} section '{section}'")
    if isinstance(data.get("scheme"), dict):
        _refuse_unknown(data["scheme"], SCHEME_KEYS, f"recipe {source} section 'scheme'")
    return data


SCHEME_KEYS = {"bits", "group_size", "sym", "ignore", "overrides"}


def recipe_run_defaults(recipe_file) -> dict[str, Any]:
    """The source model and output settings a recipe.yaml recorded (model, dtype, max_shard_size), used
    where the caller gives none; {} without a recipe."""
    if not recipe_file:
        return {}
    rec = read_recipe_file(recipe_file)
    recorded = {k: v for k, v in {**(rec.get("source") or {}), **(rec.get("output") or {})}.items() if v is not None}
    for key, value in recorded.items():
        if not isinstance(value, str) and not (key == "max_shard_size" and type(value) is int):
            raise QuantkitError(f"recipe {recipe_file}: {key} must be a string, got {value!r}; fix the file")
    return recorded


def _refuse_unknown(d: dict, allowed: set, where: str) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise QuantkitError(f"{where} has unknown keys {unknown}; allowed: {sorted(allowed)}")


def parse_option_value(text: str) -> Any:
    """A --option value: an int or float as Python reads it (so 1e-2 is 0.01, which YAML 1.1 would
    leave a string), else YAML (true/false/null, lists), else the text itself."""
    import yaml

    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def resolve_plan(method=None, *, recipe_file=None, options: Optional[dict] = None, bits=None, group_size=None,
                 sym=None, ignore=None, format=None, gguf_type=None, calibration: Optional[dict] = None,
                 scheme: Optional[str] = None, kv_cache_scheme: Optional[str] = None) -> QuantizePlan:
    """Recipe file + explicit arguments (which win) -> a frozen plan. `calibration` holds only the
    calibration arguments the caller gave explicitly (dataset, num_samples, ...); `scheme` a preset name."""
    for flag, value in (("--recipe", recipe_file), ("--format", format), ("--gguf-type", gguf_type),
                        ("--scheme", scheme)):
        if isinstance(value, str) and not value.strip():
            raise QuantkitError(f"{flag} is empty; give a value or leave the option out")
    rec = read_recipe_file(recipe_file) if recipe_file else {}
    flags_given = scheme is not None or any(v is not None for v in (method, bits, group_size, sym, format)) \
        or bool(ignore) or bool(options)  # then a recipe.yaml's per-linear schemes no longer bind
    preset, rec, (method, bits, group_size, sym, format) = _named_scheme(scheme, rec, method, bits, group_size, sym,
                                                                         format)
    if preset is not None and preset.float_grid and method is None:  # the preset's own default method
        from quantkit.float_checkpoint import DEFAULT_METHODS

        method, defaults = DEFAULT_METHODS.get(preset.name, (DEFAULT_METHOD, {}))
        options = {**defaults, **(options or {})}
    all_options = {**(rec.get("options") or {}), **(options or {})}
    if not (preset is not None and preset.float_grid and preset.weights.kind == "float"):
        _refuse_float_only(all_options)
    recipe = build_recipe(method if method is not None else rec.get("method", DEFAULT_METHOD), all_options)
    if preset is not None and preset.float_grid:
        _check_float_preset(preset, recipe, options, gguf_type)
    quant_scheme = _scheme(recipe, rec.get("scheme") or {}, bits=bits, group_size=group_size, sym=sym, ignore=ignore,
                           check=preset is None or not preset.float_grid)  # a float preset: checked above
    gguf_type = gguf_type if gguf_type is not None else rec.get("gguf_type")
    format_name = str(format or rec.get("format") or recipe.default_format)
    if format_name.lower() == "gguf":
        format_name, gguf_type = "gguf", _gguf_type(recipe, quant_scheme, gguf_type)
    elif gguf_type is not None:
        raise QuantkitError("--gguf-type needs --format gguf")
    elif preset is None or not preset.float_grid:
        _check_format(recipe, format_name)
    _check_sym_range(options or {}, quant_scheme, format_name)
    replay = replay_of(rec, str(recipe_file), calibration or {}, flags_given) if rec else None
    kv_cache = _kv_cache(kv_cache_scheme if kv_cache_scheme is not None else rec.get("kv_cache_scheme"), format_name)
    return QuantizePlan(recipe=recipe, scheme=quant_scheme, format=format_name, gguf_type=gguf_type, preset=preset,
                        replay=replay, kv_cache=kv_cache,
                        calibration=_calibration(recipe, rec.get("calibration") or {}, calibration or {},
                                                 needed=(preset is not None and preset.calibrates_activations)
                                                 or kv_cache is not None))


def _kv_cache(name: Optional[str], format_name: str):
    """--kv-cache-scheme as a KVCacheScheme; only compressed-tensors declares KV-cache scales (its
    kv_cache_scheme), so the other formats refuse it."""
    from quantkit.kv_calibration import parse_kv_cache_scheme

    kv = parse_kv_cache_scheme(name)
    if kv is not None and format_name != "compressed-tensors":
        raise QuantkitError(f"--kv-cache-scheme: the {format_name} format has no place for KV-cache scales (vLLM reads "
                            "them from a compressed-tensors kv_cache_scheme); use --format compressed-tensors or drop "
                            "--kv-cache-scheme")
    return kv


def _named_scheme(scheme: Optional[str], rec: dict, method, bits, group_size, sym, format):
    """(the preset or None, the recipe without a scheme the preset replaces, (method, bits, group_size, sym,
    format) as the preset sets them). The name comes from --scheme, else the recipe's `scheme: NAME`, else
    a recipe.yaml's `resolved.preset` (an integer preset written out as its bits and group size)."""
    from quantkit.scheme_presets import preset as preset_named

    recorded = (rec.get("resolved") or {}).get("preset")
    if scheme is None and isinstance(rec.get("scheme"), str):
        scheme = rec["scheme"]
    elif scheme is None and recorded is not None and bits is None and group_size is None and sym is None:
        return preset_named(recorded), rec, (method, bits, group_size, sym, format)
    if scheme is None:
        return None, rec, (method, bits, group_size, sym, format)
    p, method, flags = _preset_flags(scheme, method if method is not None else rec.get("method"), bits=bits,
                                     group_size=group_size, sym=sym, format=format)
    return p, {**rec, "scheme": None}, (method, *flags)


def _preset_flags(name: str, method, *, bits, group_size, sym, format):
    """(the preset, the method, (bits, group_size, sym, format)) for --scheme NAME: an integer preset is
    its bits / group size / symmetry on the existing path (W8A8: SmoothQuant's int8 weights and
    activations); contradicting flags are refused."""
    from quantkit.scheme_presets import check_flags_agree, preset

    p = preset(name)
    g = parse_group_size(group_size)
    check_flags_agree(p, bits=bits, group_size=g if g != "auto" else None, sym=sym)
    if g == "auto":
        raise QuantkitError(f"--scheme {p.name} fixes the group size; drop --group-size auto")
    w = p.weights
    if p.float_grid:
        if format is not None and format != "compressed-tensors":
            raise QuantkitError(f"--scheme {p.name} is written as compressed-tensors; drop --format {format}")
        return p, method, (w.bits, None, None, "compressed-tensors")
    acts = p.input_activations
    if acts is not None:  # W8A8: int8 per-channel weights, int8 dynamic per-token activations
        method = "smoothquant" if method is None else method
        if not build_recipe(method, {}).quantizes_activations:
            raise QuantkitError(f"--scheme {p.name} quantizes activations; method {method!r} does not: use "
                                "--method smoothquant or smoothquant,gptq (or drop --method)")
    elif method is not None and build_recipe(method, {}).quantizes_activations:
        raise QuantkitError(f"--scheme {p.name} keeps activations in 16 bits; method {method!r} quantizes them: "
                            "choose a weight-only method (rtn, gptq, awq) or --scheme W8A8")
    group = {"group": w.group_size, "channel": -1}.get(w.strategy)
    if group is None:
        raise QuantkitError(f"--scheme {p.name}: integer weights per {w.strategy} are not written; use W4A16 or W8A16")
    return p, method, (w.bits, group, w.symmetric, format or "compressed-tensors")


def _refuse_float_only(options: dict) -> None:
    """GPTQ's input rounding exists for float presets only: on integer weights it would change nothing."""
    from quantkit.quantizers.gptq import FLOAT_ONLY_OPTIONS, float_only_refusal

    given = {k: options[k] for k in FLOAT_ONLY_OPTIONS if k in options}
    if given:
        raise QuantkitError(float_only_refusal(given))


def _check_float_preset(p: SchemePreset, recipe: Recipe, options: Optional[dict], gguf_type) -> None:
    """A float preset is written by round-to-nearest or GPTQ onto its grid (quantkit.float_checkpoint), either
    after a pass (quantizers.float_passes: SmoothQuant where the preset quantizes activations, AWQ's scale
    search); GPTQ there takes only the options its float solve declares (quantizers.gptq_float), a pass only
    its own."""
    from quantkit.float_checkpoint import METHODS, layout_of
    from quantkit.quantizers import float_passes
    from quantkit.quantizers.gptq_float import FloatGPTQ
    from quantkit.run_recipe import non_default_options

    if recipe.name not in METHODS:
        raise QuantkitError(f"--scheme {p.name} is written by --method {', '.join(METHODS)}; drop --method "
                            f"{recipe.name}")
    if gguf_type is not None:
        raise QuantkitError(f"--scheme {p.name} is a compressed-tensors scheme; drop --gguf-type")
    first, finish = float_passes.parse_method(recipe.name, p)
    given = dict(non_default_options(recipe))
    declared = recipe.transforms[0].options_spec if first is not None else {}
    if first is not None:  # the transform's options are the pass's, as given (a default-valued one too); its
        asked = {**given, **(options or {})}  # refusals (a preset it cannot serve, an option it does not take) first
        first.make(p, {k: v for k, v in asked.items() if k in declared})
        given = {k: v for k, v in given.items() if k not in declared}
    if p.weights.kind == "int":  # W4AFP8: the integer RTN / GPTQ steps with their own options
        layout_of(p)
        return
    asked = sorted(set(options or {}) - set(declared))  # as the user gave them (a default-valued one too)
    if finish == "rtn" and asked:
        raise QuantkitError(f"--scheme {p.name} with round-to-nearest takes no method options; drop "
                            f"{', '.join(asked)}")
    takes = dict(FloatGPTQ.options_spec)
    if finish.endswith("+signround"):
        from quantkit.float_checkpoint import float_signround
        from quantkit.quantizers.signround import SignRoundRefiner

        takes.update(SignRoundRefiner.options_spec)
        float_signround(given)  # its refusals (options, the starts a float grid cannot give) before any work
    unknown = sorted(set(given) - set(takes))
    if unknown:
        raise QuantkitError(f"{finish.replace('+', ' + ')} on --scheme {p.name}'s float grid takes only "
                            f"{', '.join(takes)}; drop {', '.join(unknown)}")
    if finish.startswith("gptq"):  # the float solve's own refusals (input rounding on a weight-only preset...)
        FloatGPTQ(p.weights, p.input_activations, **{k: v for k, v in given.items() if k in FloatGPTQ.options_spec})
    layout_of(p)  # the format's own refusal, with its reason


def _check_sym_range(options: dict, scheme: QuantScheme, format_name: str) -> None:
    """`sym_range` places a symmetric integer grid; asked for (--option / options=) on an asymmetric scheme or
    GGUF's fixed block grids it would change nothing, so it is refused rather than silently ignored. A recipe's
    own setting is not refused: `--recipe best-w4 --asym` keeps the recipe's other options."""
    asked = options.get("sym_range")
    if asked is None:
        return
    if format_name == "gguf":
        raise QuantkitError(f"sym_range={asked} has no effect on GGUF, whose types fix their own grids; drop "
                            "the sym_range option (or choose --gguf-type Q4_0 for llama.cpp's full-range grid)")
    if not scheme.sym:
        raise QuantkitError(f"sym_range={asked} places a symmetric grid, but the scheme is asymmetric; add --sym "
                            "or drop the sym_range option")


def _gguf_type(recipe: Recipe, scheme: QuantScheme, gguf_type: Optional[str]) -> str:
    """The llama.cpp type (or mix) to quantize onto: the one asked for, else the scheme's match."""
    from quantkit.formats.gguf.types import check_gguf_type
    from quantkit.formats.gguf.export import default_gguf_type

    if not recipe.quantizer.supports_grids:
        raise QuantkitError(f"method {recipe.name!r} cannot quantize onto GGUF's block grids; use --method gptq or rtn")
    unfit = [s.name for s in recipe.refiners if not s.supports_grids]
    if unfit:
        raise QuantkitError(f"{', '.join(unfit)} tunes integer grids with a zero point, not GGUF's block grids; drop it "
                            "from the method for GGUF output (for --recipe best-w4: --recipe gptaq-w4)")
    if recipe.quantizes_activations:
        raise QuantkitError(f"method {recipe.name!r} quantizes activations (W8A8), which GGUF cannot store; "
                            "use --format compressed-tensors")
    return check_gguf_type(gguf_type or default_gguf_type(scheme.bits, scheme.sym))


def _scheme(recipe: Recipe, from_file: dict, check: bool = True, **flags) -> QuantScheme:
    scheme_dict = {**recipe.default_scheme, **from_file}
    flags["group_size"] = parse_group_size(flags["group_size"])
    scheme_dict.update({k: v for k, v in flags.items() if v is not None})
    scheme = scheme_from_dict(scheme_dict).with_default_sym(recipe.default_sym)
    if check:
        recipe.check_scheme(scheme)
    return scheme


def _check_format(recipe: Recipe, format_name: str) -> None:
    from quantkit.formats import FORMATS, get_format

    if str(format_name).lower().replace("_", "-") not in FORMATS:  # gguf is settled before this check
        raise QuantkitError(f"unknown checkpoint format {format_name!r}; choose one of {', '.join([*FORMATS, 'gguf'])}")
    fmt = get_format(format_name)
    if recipe.quantizes_activations and not getattr(fmt, "ACTIVATION_STRATEGIES", None):
        raise QuantkitError(f"method {recipe.name!r} quantizes activations (W8A8), which the {fmt.NAME} format "
                            "cannot store; use --format compressed-tensors")


def _calibration(recipe: Recipe, from_file: dict, explicit: dict, needed: bool = False) -> Optional[Calibration]:
    """The calibration settings, None when neither the method nor the scheme (`needed`: a preset whose
    checkpoint stores calibrated input scales, FP8 / NVFP4) reads data."""
    given = {k: v for k, v in explicit.items() if v is not None and v is not False}
    # a recipe.yaml's nulls mean "not chosen" (in-memory rows size themselves); its token hash is the Replay's
    from_file = {k: v for k, v in from_file.items() if v is not None and k not in TOKEN_KEYS}
    _refuse_unknown(given, CALIBRATION_KEYS, "calibration settings")
    if not recipe.needs_calibration and not needed:
        used = sorted({*given, *from_file})
        if used:
            flags = ", ".join("--" + k.replace("_", "-") for k in used)
            raise QuantkitError(f"method {recipe.name!r} reads no calibration data, so {flags} would be ignored; "
                                "drop them (or choose a calibrating method such as gptq)")
        return None
    c = {**CALIBRATION_DEFAULTS, **from_file, **given}
    for key in ("num_samples", "seq_len", "seed"):
        if isinstance(c[key], bool) or not isinstance(c[key], int):
            raise QuantkitError(f"calibration {key} must be an integer, got {c[key]!r}")
    if c["num_samples"] < 1 or c["seq_len"] < 2:
        raise QuantkitError("--num-samples must be at least 1 and --seq-len at least 2")
    if c["batch_size"] is not None and (isinstance(c["batch_size"], bool) or not isinstance(c["batch_size"], int)
                                        or c["batch_size"] < 1):
        raise QuantkitError(f"--batch-size must be a positive integer, got {c['batch_size']!r}")
    calibration = Calibration(dataset=c["dataset"], num_samples=c["num_samples"], seq_len=c["seq_len"], seed=c["seed"],
                              chat_template=bool(c["chat_template"]), batch_size=c["batch_size"],
                              moe_calibration=c["moe_calibration"], moe_min_tokens=c["moe_min_tokens"],
                              explicit=frozenset({*from_file, *given}))
    calibration.expert_policy()  # a bad value is refused here, before any model is loaded
    return calibration
