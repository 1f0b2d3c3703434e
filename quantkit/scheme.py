"""What to quantize and how: bits, group size, symmetry, per-module overrides, the ignore list.

A `QuantScheme` is declared once (CLI flags over a YAML recipe) and resolved against a concrete
model into one `LinearScheme` per target linear, so every later stage sees plain numbers and a
bad choice (bits 5, a group size that does not divide a layer) fails before any work starts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

from quantkit.errors import QuantkitError

SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)
DEFAULT_IGNORE = (r"(^|\.)lm_head$",)


@dataclass(frozen=True)
class LinearScheme:
    """The resolved scheme of one linear."""

    bits: int
    group_size: int  # -1: one group per output channel
    sym: bool
    grid: Optional[str] = None  # a target format's fixed grid (a GGUF type such as "Q4_K"); None: the method's own


@dataclass(frozen=True)
class Override:
    pattern: str
    bits: Optional[int] = None
    group_size: Union[int, str, None] = None
    sym: Optional[bool] = None


@dataclass(frozen=True)
class QuantScheme:
    bits: int = 4
    group_size: Union[int, str] = "auto"
    sym: Optional[bool] = None  # None: the method's usual default
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    overrides: tuple[Override, ...] = field(default_factory=tuple)

    def __post_init__(self):
        check_bits(self.bits)
        check_group_size_value(self.group_size)
        for o in self.overrides:
            if o.bits is not None:
                check_bits(o.bits)
            if o.group_size is not None:
                check_group_size_value(o.group_size)
        for pattern in (*self.ignore, *(o.pattern for o in self.overrides)):
            try:
                re.compile(pattern)
            except re.error as exc:
                raise QuantkitError(f"invalid module regex {pattern!r}: {exc}; fix the pattern in the recipe or --ignore") from None

    def with_default_sym(self, sym: bool) -> "QuantScheme":
        return self if self.sym is not None else replace(self, sym=sym)

    def is_ignored(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.ignore)

    def resolve(self, linear_shapes: dict[str, tuple[int, int]]) -> dict[str, LinearScheme]:
        """One LinearScheme per non-ignored linear ({name: (out, in)}); checks every group size divides."""
        targets = {n: s for n, s in linear_shapes.items() if not self.is_ignored(n)}
        if not targets:
            raise QuantkitError("no linear layers left to quantize after the ignore list; loosen --ignore")
        sym = True if self.sym is None else self.sym
        resolved = {}
        auto_group = _auto_group_size([s[1] for s in targets.values()]) if self.group_size == "auto" else None
        for name, (_, in_features) in targets.items():
            bits, group, sym_n = self.bits, self.group_size, sym
            for o in self.overrides:
                if re.search(o.pattern, name):
                    bits = o.bits if o.bits is not None else bits
                    group = o.group_size if o.group_size is not None else group
                    sym_n = o.sym if o.sym is not None else sym_n
            if group == "auto":
                group = auto_group if auto_group is not None else _auto_group_size([in_features])
            if group != -1 and in_features % group:
                raise QuantkitError(
                    f"group size {group} does not divide {name}'s input size {in_features}; "
                    f"use --group-size {_auto_group_size([in_features])} (or auto)"
                )
            resolved[name] = LinearScheme(bits=bits, group_size=int(group), sym=sym_n)
        return resolved


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise QuantkitError(f"unsupported bits {bits}; choose one of {', '.join(map(str, SUPPORTED_BITS))}")


def check_group_size_value(group_size) -> None:
    if group_size == "auto":
        return
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size not in SUPPORTED_GROUP_SIZES:
        raise QuantkitError(f"unsupported group size {group_size!r}; choose 32, 64, 128, -1 (per channel) or auto")


def _auto_group_size(in_sizes: list[int]) -> int:
    """128 where it divides every input size, else the largest of 64 and 32 that does, else per channel."""
    for g in (128, 64, 32):
        if all(k % g == 0 for k in in_sizes):
            return g
    return -1


def parse_group_size(value: Union[str, int, None]):
    if value is None:
        return None
    if isinstance(value, int):
        return value
    v = str(value).strip().lower()
    if v == "auto":
        return "auto"
    try:
        return int(v)
    except ValueError:
        raise QuantkitError(f"unsupported group size {value!r}; choose 32, 64, 128, -1 (per channel) or auto") from None


def scheme_from_dict(d: dict[str, Any]) -> QuantScheme:
    d = dict(d or {})
    unknown = set(d) - {"bits", "group_size", "sym", "ignore", "overrides"}
    if unknown:
        raise QuantkitError(f"unknown scheme keys {sorted(unknown)}; allowed: bits, group_size, sym, ignore, overrides")
    overrides = []
    for o in d.pop("overrides", None) or []:
        if not isinstance(o, dict) or "pattern" not in o:
            raise QuantkitError("each scheme override needs a 'pattern' regex plus bits/group_size/sym")
        overrides.append(Override(pattern=o["pattern"], bits=o.get("bits"),
                                  group_size=parse_group_size(o.get("group_size")), sym=o.get("sym")))
    if "group_size" in d:
        d["group_size"] = parse_group_size(d["group_size"])
    if "ignore" in d:
        d["ignore"] = tuple(d["ignore"] or ())
    return QuantScheme(overrides=tuple(overrides), **d)
