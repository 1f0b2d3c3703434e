"""Architecture adapters: where things live in a transformers causal LM, and which linears share an input.

Layer-by-layer calibration, GPTQ, AWQ and SmoothQuant are written once against this interface
instead of against the module names of every model family. An adapter is stateless: it reads
module names and shapes, never weights, so one instance serves every model of its family.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from quantkit.errors import QuantkitError
from quantkit.models.layout import DecoderLayout

NORM = "norm"
LINEAR = "linear"
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

# Kept sorted: it is printed in the "unsupported architecture" error.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("deepseek_v3", "llama", "mistral", "mixtral", "olmoe", "opt", "phi3", "qwen2",
                                          "qwen2_moe", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class InputGroup:
    """Linears fed by the same input, and the module that produces that input.

    A per-input-channel scale ``s`` can be moved out of the linears (weight columns * s) and into
    ``prev`` (its output / s) without changing the full-precision function; AWQ and SmoothQuant
    use exactly that freedom (see ``quantkit.models.folding.fold_scales``).

    prev:      name, relative to the decoder layer, of the module whose output feeds ``linears``:
               a norm ("input_layernorm") or a linear ("self_attn.v_proj", "mlp.up_proj").
    linears:   the linears that consume that output, e.g. the q, k and v projections.
    inspect:   the module whose output is the group's "block output" for AWQ's loss ("self_attn"
               for qkv, "mlp" for gate/up, the linear itself for v->o and up->down).
    kind:      "norm" or "linear": how ``prev`` is folded.
    prev_rows: for a fused linear ``prev`` (Phi-3 qkv_proj, gate_up_proj), the half-open range
               ``(start, stop)`` of its output rows that feed ``linears``; only those rows may be
               rescaled. None means all rows.
    token_wise: ``inspect`` maps each token on its own (an MLP), so AWQ may measure its loss on a
               strided sample of tokens instead of whole sequences. A linear ``inspect`` is always
               token-wise; attention never is (the default, False, is the safe answer).
    input_of:  the module whose input is the group's input, where its statistics are read (default:
               the first linear). A MoE block's experts each see only the tokens routed to them, so
               for norm -> every expert's gate/up it is the MoE block itself.
    followers: modules that read the same input but are not part of the search (a MoE router, a
               shared-expert gate): folding multiplies their weight columns by ``s`` too, so they
               compute exactly what they did (the router routes the same tokens to the same experts).
    kv_heads:  ``(head_dim, n_rep)`` for v -> o under grouped-query attention: o's input channel
               ``h * head_dim + d`` reads v's output row ``(h // n_rep) * head_dim + d`` (transformers'
               ``repeat_kv``), so a scale can be folded into v only if it is equal on the ``n_rep``
               channels that share a row (``tie`` makes a per-channel vector so). None: one input
               channel per prev row.
    """

    prev: str
    linears: tuple[str, ...]
    inspect: str
    kind: str
    prev_rows: tuple[int, int] | None = None
    token_wise: bool = False
    input_of: str | None = None
    followers: tuple[str, ...] = ()
    kv_heads: tuple[int, int] | None = None

    @property
    def input_module(self) -> str:
        """Where the group's input is read (see ``input_of``)."""
        return self.input_of or self.linears[0]

    def tie(self, v: torch.Tensor) -> torch.Tensor:
        """A per-input-channel vector made equal on the channels that share a prev row (their mean);
        unchanged when every channel has its own row."""
        if self.kv_heads is None:
            return v
        head_dim, n_rep = self.kv_heads
        shared = v.reshape(-1, n_rep, head_dim)  # [kv heads, n_rep, head_dim]
        return shared.mean(dim=1, keepdim=True).expand_as(shared).reshape(v.shape)

    def prev_scales(self, s: torch.Tensor) -> torch.Tensor:
        """The scale of each prev row for the per-input-channel ``s``, which must be tied."""
        if self.kv_heads is None:
            return s
        head_dim, n_rep = self.kv_heads
        shared = s.reshape(-1, n_rep, head_dim)
        if not torch.equal(shared, shared[:, :1].expand_as(shared)):
            raise ValueError(f"{self.linears}: the scales differ between query heads sharing a value head "
                             "(tie them with InputGroup.tie)")
        return shared[:, 0].reshape(-1)

    def __post_init__(self):
        if self.kind not in (NORM, LINEAR):
            raise ValueError(f"InputGroup.kind must be 'norm' or 'linear', got {self.kind!r}")
        if not self.linears:
            raise ValueError("InputGroup.linears must not be empty")
        if self.prev_rows is not None:
            if self.kind != LINEAR:
                raise ValueError("InputGroup.prev_rows only applies to kind 'linear'")
            start, stop = self.prev_rows
            if not 0 <= start < stop:
                raise ValueError(f"InputGroup.prev_rows must be a non-empty range, got {self.prev_rows}")
        if self.kv_heads is not None and (self.kind != LINEAR or min(self.kv_heads) < 1):
            raise ValueError(f"InputGroup.kv_heads needs kind 'linear' and positive sizes, got {self.kv_heads}")


@dataclass(frozen=True)
class GatedMLP:
    """Where a decoder layer's MLP computing ``down(act(gate(x)) * up(x))`` token by token lives
    (names relative to the layer). Knowing it lets the one-pass GPTQ driver run the MLP in token
    chunks, so its widest activations (gate, up, their product) never exist for the whole
    calibration set at once."""

    module: str
    gate: str
    up: str
    down: str
    act: str
    # the decoder layer is a sequential pre-norm residual block (`residual` is rebound to the
    # attention sum before the MLP, and the MLP's input is not read after it): the one-pass driver
    # may then free the layer's input when the MLP starts (transformers' forward wrappers keep their
    # arguments referenced until they return) and write the MLP's output over the MLP's input
    sequential_residual: bool = False


@dataclass(frozen=True)
class AttentionBlock:
    """Where a decoder layer's self-attention lives (names relative to the layer): the module, the
    projections reading its input and the output projection, which its forward calls last on the
    attention output. Sequences attend independently, so the one-pass GPTQ driver can run the
    module a few sequences at a time: its temporaries (q/k/v, rotary, attention output) stay
    cache-sized and are reused from the heap instead of being page-faulted in for the whole set."""

    module: str
    inputs: tuple[str, ...]
    output: str


@dataclass(frozen=True)
class MoEBlock:
    """Where a decoder layer's sparse MoE block lives (names relative to the layer).

    The routed experts are one transformers module holding fused 3-D weights; quantkit handles them
    as the per-expert linears ``{experts}.{e}.gate_proj/up_proj/down_proj`` (quantkit.models.experts).
    The router reads the block's input and is never quantized; a shared expert (an ordinary gated MLP
    every token goes through) and its sigmoid gate read it too."""

    module: str  # the block, e.g. "mlp"
    router: str  # e.g. "mlp.gate" (a TopKRouter: weight [E, H], not an nn.Linear)
    experts: str  # e.g. "mlp.experts"
    num_experts: int
    shared: str | None = None  # the shared expert MLP, e.g. "mlp.shared_expert"
    shared_gate: str | None = None  # e.g. "mlp.shared_expert_gate" (nn.Linear(H, 1), kept in full precision)

    def expert_linear(self, e: int, projection: str) -> str:
        return f"{self.experts}.{e}.{projection}"

    def expert_linears(self, projections: tuple[str, ...]) -> list[str]:
        return [self.expert_linear(e, p) for e in range(self.num_experts) for p in projections]

    def shared_linears(self, projections: tuple[str, ...]) -> list[str]:
        return [f"{self.shared}.{p}" for p in projections] if self.shared else []


def resolve(root: nn.Module, path: str) -> nn.Module:
    """``root.get_submodule(path)``, but a missing module is a one-line QuantkitError.

    The usual cause is handing quantkit a base model (``AutoModel``) or a remote-code variant
    whose module names differ from the transformers implementation the adapter was written for.
    """
    try:
        return root.get_submodule(path)
    except AttributeError:
        raise QuantkitError(
            f"{type(root).__name__} has no module '{path}'; quantkit expects a transformers causal LM "
            f"(AutoModelForCausalLM) with the standard module layout"
        ) from None


class ArchitectureAdapter:
    """Where the parts of one family of causal LMs live. Subclasses fill in the names."""

    model_types: tuple[str, ...] = ()

    # -- whole-model structure -------------------------------------------------------------
    def layers_prefix(self, model: nn.Module) -> str:
        """Dotted path of the decoder ModuleList, e.g. "model.layers"."""
        raise NotImplementedError

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        layers = resolve(model, self.layers_prefix(model))
        if not isinstance(layers, nn.ModuleList):
            raise QuantkitError(
                f"'{self.layers_prefix(model)}' of {type(model).__name__} is a {type(layers).__name__}, "
                "expected the ModuleList of decoder layers"
            )
        return layers

    def layer_name(self, model: nn.Module, index: int, name: str = "") -> str:
        """Fully qualified name of ``name`` inside decoder layer ``index``."""
        base = f"{self.layers_prefix(model)}.{index}"
        return f"{base}.{name}" if name else base

    def embeddings(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Modules that run before layer 0 (fully qualified names), in execution order."""
        raise NotImplementedError

    def final_norm(self, model: nn.Module) -> tuple[str, nn.Module] | None:
        """The norm applied to the last layer's output, or None where the model has none (post-LN OPT)."""
        raise NotImplementedError

    def post_layers(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Every module between the last decoder layer and lm_head, in execution order.

        Usually just the final norm; OPT may add ``project_out`` or have no norm at all, so code that
        turns last-layer hidden states into logits should apply these rather than only final_norm.
        """
        norm = self.final_norm(model)
        return [norm] if norm is not None else []

    def lm_head(self, model: nn.Module) -> tuple[str, nn.Module]:
        return "lm_head", resolve(model, "lm_head")

    def rotary_embedding(self, model: nn.Module) -> nn.Module | None:
        """The shared rotary-embedding module (position_embeddings for every layer), if any."""
        return None

    # -- one decoder layer --------------------------------------------------------------------
    def _linear_names(self, layer: nn.Module) -> list[str]:
        raise NotImplementedError

    def linear_names(self, layer: nn.Module) -> list[str]:
        """All nn.Linear names inside one decoder layer, in execution order.

        Checked against the layer: a linear the adapter does not know about would otherwise be
        silently left unquantized, so an unexpected layout is an error instead.
        """
        names = self._linear_names(layer)
        for name in names:
            if not isinstance(resolve(layer, name), nn.Linear):
                raise QuantkitError(f"'{name}' in {type(layer).__name__} is not an nn.Linear; unsupported layout")
        present = {n for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        unknown = sorted(present - set(names))
        if unknown:
            raise QuantkitError(
                f"{type(layer).__name__} has linears quantkit does not know about ({', '.join(unknown)}); "
                "unsupported layout"
            )
        return names

    def sequential_stages(self, layer: nn.Module) -> list[list[str]]:
        """Linears grouped by true-sequential order: each stage sees the previous stages quantized."""
        raise NotImplementedError

    def gated_mlp(self, layer: nn.Module) -> GatedMLP | None:
        """The layer's gated MLP, if it has one of that exact form (None: run the module as it is)."""
        return None

    def attention(self, layer: nn.Module) -> AttentionBlock | None:
        """The layer's self-attention, if its forward is transformers' Llama form (None: run it whole)."""
        return None

    def decoder_layout(self, model: nn.Module) -> "DecoderLayout":
        """The forward's shape for an inference engine (``quantkit.models.layout``)."""
        raise QuantkitError(f"the engine does not run {type(model).__name__} models yet")

    def input_groups(self, layer: nn.Module, config=None) -> list[InputGroup]:
        """Groups of linears sharing an input, with where to fold a per-channel scale.

        Only mappings whose folding is exact in full precision are returned. ``config`` is accepted
        for interface symmetry; adapters read the facts they need from the layer's own modules.
        """
        raise NotImplementedError

    # -- mixture of experts (none in dense families) -------------------------------------------
    def moe_blocks(self, layer: nn.Module) -> list[MoEBlock]:
        """The layer's sparse MoE blocks (dense layers and dense families: none)."""
        return []

    def routed_linears(self, layer: nn.Module) -> frozenset[str]:
        """Linears that see only the tokens a router sends them, possibly none (routed experts)."""
        return frozenset(n for b in self.moe_blocks(layer) for n in b.expert_linears(EXPERT_PROJECTIONS))

    def linear_shapes(self, model: nn.Module) -> dict[str, tuple[int, int]]:
        """Every linear quantkit may quantize, name -> (out, in): the model's nn.Linear modules, plus
        each fused routed expert's projections as the per-expert linears they become while a layer
        is calibrated (named as checkpoints name them)."""
        shapes = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        prefix = self.layers_prefix(model)
        for i, layer in enumerate(self.decoder_layers(model)):
            for block in self.moe_blocks(layer):
                fused = resolve(layer, block.experts)
                gate_up = getattr(fused, "gate_up_proj", None)
                if not isinstance(gate_up, torch.Tensor):
                    continue  # already per-expert linears (a loaded quantized model)
                _, two_i, h = gate_up.shape
                for e in range(block.num_experts):
                    shapes[f"{prefix}.{i}.{block.expert_linear(e, 'gate_proj')}"] = (two_i // 2, h)
                    shapes[f"{prefix}.{i}.{block.expert_linear(e, 'up_proj')}"] = (two_i // 2, h)
                    shapes[f"{prefix}.{i}.{block.expert_linear(e, 'down_proj')}"] = (h, two_i // 2)
        return shapes

    def full_precision_modules(self, model: nn.Module) -> list[str]:
        """Modules that stay unquantized whatever the scheme (routers, shared-expert gates), named so a
        checkpoint's quantization_config can declare them (vLLM builds them unquantized)."""
        return []

    # -- checkpoint names ----------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str:
        """The name a module or tensor has in the family's checkpoints (identity where transformers'
        own module names are the checkpoint's)."""
        return name

    def model_name(self, name: str) -> str:
        """The inverse of ``checkpoint_name``."""
        return name


def get_adapter(model_or_config) -> ArchitectureAdapter:
    """The adapter for a model, its config, or a model_type string, chosen by ``config.model_type``."""
    if isinstance(model_or_config, str):
        model_type = model_or_config
    else:
        config = getattr(model_or_config, "config", model_or_config)
        model_type = getattr(config, "model_type", None)
    adapter = _registry().get(model_type)
    if adapter is None:
        raise QuantkitError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return adapter


_REGISTRY: dict[str, ArchitectureAdapter] | None = None


def _registry() -> dict[str, ArchitectureAdapter]:
    # Imported lazily: the adapter modules import this one.
    global _REGISTRY
    if _REGISTRY is None:
        from quantkit.models.llama import LlamaAdapter
        from quantkit.models.moe import (DeepseekV3Adapter, MixtralAdapter, OlmoeAdapter, Qwen2MoEAdapter,
                                         Qwen3MoEAdapter)
        from quantkit.models.opt import OPTAdapter
        from quantkit.models.phi3 import Phi3Adapter

        registry = {}
        for adapter in (LlamaAdapter(), OPTAdapter(), Phi3Adapter(), MixtralAdapter(), Qwen2MoEAdapter(),
                        Qwen3MoEAdapter(), OlmoeAdapter(), DeepseekV3Adapter()):
            for model_type in adapter.model_types:
                registry[model_type] = adapter
        assert tuple(sorted(registry)) == SUPPORTED_MODEL_TYPES, sorted(registry)
        _REGISTRY = registry
    return _REGISTRY
