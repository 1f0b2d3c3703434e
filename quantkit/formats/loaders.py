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

from typing import Iterable, Optional

from quantkit.formats.spec import LinearSpec

VLLM_VERSION = "0.32.0"
VLLM = f"vLLM {VLLM_VERSION} (CPU build)"
TRANSFORMERS = "transformers 5.25 + compressed-tensors 0.20"


def vllm_refusal(fmt: str, specs: Iterable[LinearSpec]) -> Optional[str]:
    """Why vLLM refuses a dense checkpoint of these layers, or None when it serves it (tests/test_vllm.py)."""
    specs = list(specs)
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
        return None
    return f"vLLM does not serve the {fmt} layout from a folder"


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


def loaders_checked(fmt: str, specs: Iterable[LinearSpec]) -> list[str]:
    """One line per loader for the model card: checked (and how), refused (and why), or not checked."""
    specs = list(specs)
    if fmt == "gguf":
        return ["llama.cpp (gguf): the file's blocks are decoded by the `gguf` package and, where "
                "llama-cpp-python is installed, llama.cpp's own logits (tests/test_gguf.py)"]
    refusal = vllm_refusal(fmt, specs)
    lines = [f"{VLLM}: " + (f"refuses it: {refusal}" if refusal else
                            "loads the folder unmodified; prompt log-probs checked against quantkit's "
                            "loader (tests/test_vllm.py)"),
             transformers_status(fmt, specs)]
    if fmt == "gptq":
        lines.append("GPTQModel: the layout follows its v1 `gptq` format; not loaded in a test here")
    return lines
