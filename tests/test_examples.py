"""Each script in examples/ runs as a user would run it (a subprocess), on a tiny model and on the
bundled demo model, and prints what it claims. Slow tier: a subprocess that imports torch and
transformers takes more than the fast tier's ~5 s per test (CI runs both tiers)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args, timeout: int = 900) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


def check_dataloader(out: str, folder: Path) -> None:
    assert "the in-memory model passed in is unchanged" in out
    assert re.search(r"calibrated on \d+ x \d+ tokens from: DataLoader of 6 batches: 24 token rows", out)
    digest = re.search(r"sha256 \(also on the model card\): ([0-9a-f]{64})", out).group(1)
    assert f"- calibration_tokens_sha256: `{digest}`" in (folder / "gptq-w4" / "README.md").read_text()
    assert (folder / "gptq-w4" / "model.safetensors").is_file()


def check_recipe(out: str, folder: Path) -> None:
    assert "steps: awq -> gptq; 4-bit, group 64, format gptq" in out
    assert "calibration: list of 40 chat conversations" in out
    kl = float(re.search(r"KL to the original: ([0-9.]+) per token", out).group(1))
    assert 0 <= kl < 1.0  # a 4-bit model stays close to its original; a broken one does not
    assert (folder / "awq-gptq" / "model.safetensors").is_file()


def check_generate(out: str, folder: Path) -> str:
    assert re.search(r"wrote .*rtn-w4g64: \d+ linears at 4 bits", out)
    n = int(re.search(r"wrote .*: (\d+) linears", out).group(1))
    assert f"loaded with {n} packed linears" in out
    return re.search(r"answer: (.*)", out).group(1)


def test_examples_folder_has_the_three_scripts():
    assert {p.name for p in EXAMPLES.glob("*.py")} >= {"calibrate_from_dataloader.py", "composed_recipe.py",
                                                       "quantize_load_generate.py"}


@pytest.mark.slow
def test_calibrate_from_dataloader(tiny_llama_dir, tmp_path):
    check_dataloader(run_example("calibrate_from_dataloader.py", "--model", tiny_llama_dir, "--output", tmp_path),
                     tmp_path)


@pytest.mark.slow
def test_composed_recipe(tiny_llama_dir, tmp_path):
    check_recipe(run_example("composed_recipe.py", "--model", tiny_llama_dir, "--output", tmp_path), tmp_path)


@pytest.mark.slow
def test_quantize_load_generate(tiny_llama_dir, tmp_path):
    check_generate(run_example("quantize_load_generate.py", "--model", tiny_llama_dir, "--output", tmp_path), tmp_path)


@pytest.mark.slow
def test_examples_on_the_demo_model(demo_dir, tmp_path):
    """As a user runs them: no --model, the demo. The demo's 4-bit answer still names Paris."""
    check_dataloader(run_example("calibrate_from_dataloader.py", "--output", tmp_path / "a"), tmp_path / "a")
    check_recipe(run_example("composed_recipe.py", "--output", tmp_path / "b"), tmp_path / "b")
    answer = check_generate(run_example("quantize_load_generate.py", "--output", tmp_path / "c"), tmp_path / "c")
    assert "Paris" in answer
