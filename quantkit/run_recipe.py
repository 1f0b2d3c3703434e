"""A run written back out: the plan resolved against the loaded model, saved as the checkpoint's recipe.yaml.

`quantkit.plan` resolves what can be known before loading (method, scheme, format, calibration);
the model decides the rest: each linear's scheme (group size auto, overrides, an allocation's
mixture, GGUF's per-tensor types), the calibration batch size, the MoE expert policy, the tokens'
hash. `ResolvedRun` holds all of it, frozen, and `to_yaml()` writes it in the recipe format
`quantkit.plan.read_recipe_file` reads, so `quantkit quantize --recipe <ckpt>/recipe.yaml` repeats
the run (llm-compressor's oneshot writes its recipe.yaml into the output the same way).

What a replay checks (`Replay`): the calibration tokens hash to the recorded SHA-256 (a replay on
other data is refused, not silently written with other bytes; in-memory data must be passed again,
`dataset=`), and the model resolves every linear to the recorded scheme. Run-time choices (output
folder, --overwrite, --resume, progress, --json, --eval, devices, streaming, ranks) do not change
the bytes and are not recorded; neither is trust_remote_code (a recipe never turns it on).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional

from quantkit.errors import QuantkitError

RECIPE_FILE = "recipe.yaml"
SOURCE_KEYS = {"model"}
OUTPUT_KEYS = {"dtype", "max_shard_size"}
RESOLVED_KEYS = {"linears", "expert_policy", "allocation", "preset"}
TOKEN_KEYS = {"tokens_sha256", "tokens_source"}  # calibration keys only a written recipe.yaml carries
HEADER = ("# How this checkpoint was made, written by quantkit {version}. Repeat it (the same bytes):\n"
          "#   quantkit quantize --recipe {file} --output NEW_FOLDER\n"
          "# Flags given with it override it. 'resolved' is what the plan became on the model; a replay on the same\n"
          "# model must resolve to it, and calibration.tokens_sha256 must match the tokens drawn.\n")
IN_MEMORY_NOTE = ("# The calibration was in-memory data: pass the same tokens again (quantize(..., dataset=...));\n"
                  "# other tokens are refused (tokens_sha256).\n")


@dataclass(frozen=True)
class Replay:
    """What a recipe.yaml read back promises: checked once the model is loaded and the tokens drawn."""

    source: str  # the recipe file, for messages
    source_model: Optional[str]  # None: the run quantized an in-memory model
    linears: Optional[Mapping[str, tuple]]  # name -> (bits, group_size, sym, grid); None: not checked
    tokens_sha256: Optional[str]  # None: not checked (no data, or a calibration flag overrode the recipe)
    in_memory_data: bool  # the recorded calibration was in-memory data

    def check_linears(self, schemes: dict, model: Any) -> None:
        """The model resolves each linear as recorded (when it is the recorded source model)."""
        if self.linears is None or self.source_model is None or _local_or_name(model) != self.source_model:
            return
        got = {n: _row(s) for n, s in schemes.items()}
        if got == dict(self.linears):
            return
        diff = sorted(set(got) ^ set(self.linears)) or sorted(n for n in got if got[n] != self.linears[n])
        raise QuantkitError(f"recipe {self.source}: this model resolves its linears differently from the recorded "
                            f"run (first: {diff[0]}); the recipe's 'resolved' section is for another model or "
                            "quantkit: remove that section to apply the recipe anyway")

    def check_tokens(self, tokens_sha256: Optional[str]) -> None:
        if self.tokens_sha256 is not None and tokens_sha256 != self.tokens_sha256:
            raise QuantkitError(f"recipe {self.source} was calibrated on tokens with SHA-256 "
                                f"{self.tokens_sha256[:16]}..., these hash to {str(tokens_sha256)[:16]}...; pass the "
                                "same calibration data, or give --dataset/--num-samples/--seq-len/--seed to choose new")


def _row(s) -> tuple:
    return (s.bits, s.group_size, s.sym, getattr(s, "grid", None))


def replay_of(data: dict, source: str, given_calibration: dict, scheme_flags_given: bool) -> Optional[Replay]:
    """The checks a recipe file asks for (None for a hand-written recipe: it has no 'resolved' section
    and no token hash). `given_calibration`: calibration values the caller gave (they override)."""
    cal = data.get("calibration") or {}
    resolved = data.get("resolved") or {}
    if not resolved and "tokens_sha256" not in cal:
        return None
    if not isinstance(cal.get("tokens_sha256", ""), str):
        raise QuantkitError(f"recipe {source} section 'calibration': tokens_sha256 must be a SHA-256 hex string")
    in_memory = "tokens_sha256" in cal and cal.get("dataset") is None
    if in_memory and given_calibration.get("dataset") is None:
        raise QuantkitError(f"recipe {source} was calibrated on in-memory data ({cal.get('tokens_source')}); pass the "
                            "same tokens again with dataset= (the Python API), or --dataset to calibrate on other text")
    given = {k: v for k, v in given_calibration.items() if v is not None and v is not False}  # False: a flag not given
    overridden = any(k in given and given[k] != cal.get(k) for k in ("num_samples", "seq_len", "seed", "chat_template")) \
        or (not in_memory and given.get("dataset") not in (None, cal.get("dataset")))
    linears = resolved.get("linears")
    if linears is not None and not isinstance(linears, dict):
        raise QuantkitError(f"recipe {source} section 'resolved': linears must map each linear's name to its scheme")
    if linears is not None:
        linears = MappingProxyType({n: _linear_row(n, r, source) for n, r in linears.items()})
    return Replay(source=source, source_model=(data.get("source") or {}).get("model"),
                  linears=None if scheme_flags_given else linears,
                  tokens_sha256=None if overridden else cal.get("tokens_sha256"), in_memory_data=in_memory)


def _linear_row(name: str, row: Any, source: str) -> tuple:
    keys = {"bits", "group_size", "sym", "grid"}
    if not isinstance(row, dict) or set(row) - keys:
        raise QuantkitError(f"recipe {source} section 'resolved.linears' entry {name!r} must be a mapping with keys "
                            f"{sorted(keys)}")
    return (row.get("bits"), row.get("group_size"), row.get("sym"), row.get("grid"))


@dataclass(frozen=True)
class ResolvedRun:
    """Everything one quantize run did, resolved against its model: the recipe.yaml it writes."""

    plan: Any  # quantkit.plan.QuantizePlan, its calibration carrying the drawn tokens' shape and hash
    linears: Mapping[str, Any]  # name -> quantkit.scheme.LinearScheme
    batch_size: Optional[int]  # calibration sequences per forward (None: no calibration)
    expert_policy: Any  # quantkit.pipeline.experts.ExpertPolicy, None for a dense model
    dtype: str  # the unquantized tensors' dtype as written
    max_shard_size: Optional[str]
    source_model: Optional[str]  # None: an in-memory model
    allocation: Optional[Mapping[str, Any]] = None  # a size budget's mixture (already in the scheme's overrides)

    def to_dict(self) -> dict[str, Any]:
        from quantkit import __version__

        p = self.plan
        preset = getattr(p, "preset", None)
        out: dict[str, Any] = {"quantkit": __version__, "source": {"model": _local_or_name(self.source_model)},
                               "method": method_spec(p.recipe), "format": p.format}
        if p.gguf_type is not None:
            out["gguf_type"] = p.gguf_type
        out["scheme"] = preset.name if preset is not None and preset.float_grid else scheme_dict(p.scheme)
        if getattr(p, "kv_cache", None) is not None:  # --kv-cache-scheme (only when given: older recipes unchanged)
            out["kv_cache_scheme"] = p.kv_cache.name
        out["options"] = non_default_options(p.recipe)
        out["calibration"] = self._calibration()
        out["output"] = {"dtype": self.dtype, "max_shard_size": self.max_shard_size}
        out["resolved"] = {
            "linears": {n: _linear_dict(s) for n, s in self.linears.items()},
            "expert_policy": (None if self.expert_policy is None else
                              {"mode": self.expert_policy.mode, "min_tokens": self.expert_policy.min_tokens}),
            "allocation": _plain(dict(self.allocation)) if self.allocation else None,
            "preset": preset.name if preset is not None else None}
        return out

    def _calibration(self) -> Optional[dict[str, Any]]:
        c = self.plan.calibration
        if c is None:
            return None
        named = isinstance(c.dataset, (str, Path))
        pick = (lambda k: getattr(c, k)) if named else c.given
        d = {"dataset": _dataset_name(c.dataset) if named else None, "num_samples": pick("num_samples"),
             "seq_len": pick("seq_len"), "seed": c.seed, "chat_template": c.chat_template,
             "batch_size": self.batch_size}
        if self.expert_policy is not None:
            d.update(moe_calibration=self.expert_policy.mode, moe_min_tokens=self.expert_policy.min_tokens)
        d.update(tokens_sha256=c.tokens_sha256, tokens_source=c.label())
        return d

    def to_yaml(self) -> str:
        import yaml

        from quantkit import __version__

        d = self.to_dict()
        note = IN_MEMORY_NOTE if d["calibration"] is not None and d["calibration"]["dataset"] is None else ""
        body = yaml.dump(d, Dumper=_yaml_dumper(), sort_keys=False, default_flow_style=False, width=120)
        return HEADER.format(version=__version__, file=RECIPE_FILE) + note + body


def method_spec(recipe) -> str:
    """The method as --method spells it: `gptq`, `awq` (a transform finished by rounding), `awq,gptq`."""
    return recipe.name.replace("+", ",")


def non_default_options(recipe) -> dict[str, Any]:
    """The options that differ from what `build_recipe(method_spec(recipe), {})` gives, flat (as a recipe's
    `options:` hands each to the one step declaring it)."""
    from quantkit.quantizers.recipe import build_recipe

    try:
        defaults = [s.options for s in build_recipe(method_spec(recipe), {}).steps]
    except QuantkitError:  # a Step class of the caller's own (`quantize(method=MyStep())`), registered by no name:
        defaults = [type(s).options_spec for s in recipe.steps]  # its own declared defaults
    out: dict[str, Any] = {}
    for step, base in zip(recipe.steps, defaults):
        out.update({k: _plain(v) for k, v in step.options.items() if base.get(k) != v})
    return out


def scheme_dict(scheme) -> dict[str, Any]:
    """A QuantScheme in the recipe's `scheme:` mapping (overrides included: an allocation's mixture is there)."""
    d: dict[str, Any] = {"bits": scheme.bits, "group_size": scheme.group_size, "sym": scheme.sym,
                         "ignore": list(scheme.ignore)}
    if scheme.overrides:
        d["overrides"] = [{k: v for k, v in (("pattern", o.pattern), ("bits", o.bits), ("group_size", o.group_size),
                                             ("sym", o.sym)) if v is not None} for o in scheme.overrides]
    return d


def _linear_dict(s) -> dict[str, Any]:
    d = _Row(bits=s.bits, group_size=s.group_size, sym=s.sym)
    if getattr(s, "grid", None) is not None:
        d["grid"] = s.grid
    return d


class _Row(dict):
    """A mapping written on one line (one linear's scheme), the rest of recipe.yaml in block style."""


def _yaml_dumper():
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(_Row, lambda d, row: d.represent_mapping("tag:yaml.org,2002:map", row.items(),
                                                                     flow_style=True))
    return Dumper


def _dataset_name(dataset) -> str:
    """A file as an absolute path (a replay may run elsewhere); a registry name as it is."""
    return _local_or_name(dataset)


def _local_or_name(value) -> Optional[str]:
    """A local file or folder as an absolute path; a name (demo, a hub id, a dataset name) as it is."""
    if value is None:
        return None
    path = Path(value)
    return str(path.resolve()) if path.exists() else str(value)


def _plain(value: Any) -> Any:
    """Only what YAML's safe dumper writes (numbers, strings, lists, mappings)."""
    return json.loads(json.dumps(value, default=str))


def write_recipe(folder: Path, run: ResolvedRun) -> None:
    (Path(folder) / RECIPE_FILE).write_text(run.to_yaml())
