"""Streaming: decoder-layer weights read from safetensors only while that layer is processed.

The model skeleton lives on the meta device; embeddings, final norm and head are loaded up
front; `materialize(i)` reads layer i's tensors lazily (`safe_open`) onto the CPU and `release(i)`
drops them again once its packed result is on disk. Peak host memory is then about the
embeddings + one layer + the calibration activations, whatever the model's depth.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from quantkit.errors import QuantkitError
from quantkit.finite import require_finite
from quantkit.notices import notice
from quantkit.platform_support import available_memory_bytes, glibc


def weight_files(folder: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the index or the single file (every name kept inside
    `folder` by quantkit.model_files: a hostile index must not make streaming read other files)."""
    from quantkit.model_files import check_folder_links, safetensors_shards, single_safetensors

    check_folder_links(folder)
    shards = safetensors_shards(folder)
    if shards is not None:
        return shards
    single = single_safetensors(folder)
    if single is None:
        raise QuantkitError(f"{folder} has no safetensors weights; streaming needs model.safetensors(.index.json)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def weights_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in set(weight_files(folder).values()))


def should_stream(folder: Path, compute_dtype: torch.dtype) -> bool:
    """Stream when the model in the compute dtype would take more than half the available memory.
    Where the platform does not report available memory, never stream unasked (with a notice)."""
    available = available_memory_bytes()
    if available is None:
        notice("quantkit: this platform does not report available memory, so models are not streamed "
               "automatically; pass --streaming for a model bigger than memory")
        return False
    stored = weights_bytes(folder)
    return stored * max(1, compute_dtype.itemsize // 2) > available // 2


_M_MMAP_THRESHOLD = -3  # mallopt parameter (glibc malloc.h)
_BOUNDED_MMAP_THRESHOLD = 1 << 20
_GLIBC_DEFAULT_MMAP_THRESHOLD = 128 * 1024  # mallopt(3): M_MMAP_THRESHOLD's initial value
_bounded_depth = 0


@contextmanager
def bounded_heap():
    """For a streaming run: serve every allocation of 1 MiB or more with its own mmap (glibc; a
    no-op elsewhere), and put the process's allocator back when the run ends.

    glibc raises its mmap threshold to the size of the largest block freed (up to 32 MiB), so a
    layer's many weight-sized temporaries come from the heap, fragment it and keep RSS well above
    what is alive. With a fixed threshold they go back to the OS the moment they are freed; the
    price is a page fault per fresh page. Measured on scripts/bench_streaming.py's 2.75 GB model
    (streaming, interleaved runs): RTN, 40 layers, 4 runs each: peak RSS 724-759 MB with it,
    826-850 MB without (-11.5 %), quantize 160-194 s against 148-159 s on a shared 2-core box;
    GPTQ, 12 layers, 16x256 tokens, 3 runs each: 1361-1362 MB against 1382-1471 MB (-7 %).
    On exit the threshold is glibc's default 128 KiB again, fixed: once set, glibc offers no way to
    re-enable its dynamic threshold (nor to read a value the user set with MALLOC_MMAP_THRESHOLD_)."""
    global _bounded_depth
    libc = glibc()
    if libc is None:
        yield
        return
    if _bounded_depth == 0:
        libc.mallopt(_M_MMAP_THRESHOLD, _BOUNDED_MMAP_THRESHOLD)
    _bounded_depth += 1
    try:
        yield
    finally:
        _bounded_depth -= 1
        if _bounded_depth == 0:
            libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT_MMAP_THRESHOLD)


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc `malloc_trim`; a no-op elsewhere).

    A layer's tensors and temporaries (tens of MB each) are mostly below glibc's dynamic mmap
    threshold, so they come from the heap; interleaved with the small long-lived allocations of
    each layer, the freed space is never returned and RSS grew by about one layer per layer."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


class LazyLayers:
    """Reads one decoder layer's tensors at a time into a meta-device skeleton."""

    def __init__(self, model, folder: Path, layers_prefix: str, dtype: torch.dtype):
        self.model, self.prefix, self.dtype = model, layers_prefix, dtype
        self.files = weight_files(folder)

    def load_non_layer_tensors(self) -> None:
        from accelerate.utils import set_module_tensor_to_device

        for key, value in self._read(lambda k: not k.startswith(self.prefix + ".")).items():
            set_module_tensor_to_device(self.model, key, "cpu", value=value)
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        still_meta = [n for n, p in self.model.named_parameters() if p.device.type == "meta" and not n.startswith(self.prefix + ".")]
        if still_meta:
            raise QuantkitError(f"the model folder is missing tensor {still_meta[0]}")

    def materialize(self, index: int) -> None:
        self._read_layer(index, "cpu")

    def compute_device(self, index: int, default: torch.device) -> torch.device:
        """Where layer `index` is calibrated: the run's compute device (quantkit.placement differs)."""
        return default

    def _read_layer(self, index: int, device) -> None:
        from accelerate.utils import set_module_tensor_to_device

        from quantkit.models import get_adapter

        layer_prefix = f"{self.prefix}.{index}."
        adapter = get_adapter(self.model)
        # under transformers' own names (Mixtral's checkpoints say block_sparse_moe.gate and experts.N.w1)
        read = self._read(lambda k: k.startswith(layer_prefix), copy=True)
        tensors = {adapter.model_name(k): v for k, v in read.items()}
        del read
        layer = self.model.get_submodule(f"{self.prefix}.{index}")
        tensors.update(self._fused_experts(index, layer, tensors, adapter))
        expected = {f"{layer_prefix}{n}" for n, _ in layer.named_parameters()}
        missing = sorted(expected - set(tensors))
        if missing:
            raise QuantkitError(f"the model folder is missing tensor {missing[0]}")
        for key, value in tensors.items():
            set_module_tensor_to_device(self.model, key, device, value=value)

    def _fused_experts(self, index: int, layer, tensors: dict[str, torch.Tensor], adapter) -> dict[str, torch.Tensor]:
        """Layer `index`'s fused routed-experts parameters (transformers' gate_up_proj [E, 2I, H], down_proj
        [E, H, I]) built from the per-expert tensors checkpoints hold (``experts.{e}.gate_proj.weight`` under
        transformers' names), which `tensors` gives up: what `from_pretrained` fuses on loading. Each expert's
        tensor is copied into the `models.experts.RoutedExperts` view of its rows, the layout the calibration
        pipeline and the writers use, so the fusion is theirs inverted."""
        from quantkit.models.experts import PROJECTIONS, RoutedExperts, check_fused

        out = {}
        for block in adapter.moe_blocks(layer):
            fused = layer.get_submodule(block.experts)
            names = {p: f"{self.prefix}.{index}.{block.experts}.{p}" for p in ("gate_up_proj", "down_proj")}
            if all(n in tensors for n in names.values()):
                continue  # stored fused (a checkpoint transformers saved in its own layout)
            check_fused(fused)  # the plain form the views below assume
            built = {p: torch.empty(tuple(getattr(fused, p).shape), dtype=self.dtype) for p in names}
            views = RoutedExperts.viewing(built["gate_up_proj"], built["down_proj"], fused.act_fn)
            for e, expert in enumerate(views):
                for p in PROJECTIONS:
                    key = f"{self.prefix}.{index}.{block.experts}.{e}.{p}.weight"
                    if key not in tensors:
                        raise QuantkitError(f"the model folder is missing tensor "
                                            f"{adapter.checkpoint_name(key)}")
                    view = getattr(expert, p).weight.data
                    if tuple(tensors[key].shape) != tuple(view.shape):
                        raise QuantkitError(f"{key} has shape {tuple(tensors[key].shape)}, expected "
                                            f"{tuple(view.shape)} from the config; the checkpoint does not match it")
                    view.copy_(tensors.pop(key))
            out.update({names[p]: t for p, t in built.items()})
        return out

    def release(self, index: int) -> None:
        from accelerate.utils import set_module_tensor_to_device

        layer = self.model.get_submodule(f"{self.prefix}.{index}")
        for name, _ in list(layer.named_parameters()):
            set_module_tensor_to_device(layer, name, "meta")
        trim_heap()

    def _read(self, want, copy: bool = False) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for key, path in self.files.items():
            if want(key):
                by_file.setdefault(path, []).append(key)
        out = {}
        for path, keys in by_file.items():
            # layers get owned copies, not views of the file's mapping (a weight the quantizer replaces
            # is then freed at once instead of staying resident with the mapping), each read through a
            # mapping of its own, so no more than one tensor is ever resident twice
            for group in ([[k] for k in keys] if copy else [keys]):
                with safe_open(str(path), framework="pt") as f:
                    for key in group:
                        t = f.get_tensor(key)
                        require_finite(key, t, str(path))
                        c = t.to(self.dtype) if t.is_floating_point() else t
                        out[key] = c.clone() if copy and c is t else c
                        del t, c
        return out


def load_streaming_model(folder: Path, dtype: torch.dtype, trust_remote_code: bool = False):
    """A meta-device skeleton with only the non-layer tensors loaded, plus its LazyLayers."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.eval()
    _load_generation_config(model, folder)
    from quantkit.models import get_adapter

    source = LazyLayers(model, folder, get_adapter(model).layers_prefix(model), dtype)
    source.load_non_layer_tensors()
    return model, source


def _load_generation_config(model, folder: Path) -> None:
    """The generation config exactly as `from_pretrained` (the whole-model path) builds it, so both
    paths write the same generation_config.json: the folder's file, else one read from config.json."""
    from transformers import GenerationConfig

    if getattr(model, "generation_config", None) is None:
        return
    try:
        try:
            model.generation_config = GenerationConfig.from_pretrained(folder)
        except OSError:
            model.generation_config = GenerationConfig.from_pretrained(folder, config_file_name="config.json",
                                                                       _from_model_config=True)
    except (OSError, ValueError, TypeError):
        pass  # keep the one from_config derived
