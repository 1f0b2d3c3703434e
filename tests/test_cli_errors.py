"""Bad input: exit code 2, exactly one line on stderr naming the problem, nothing of the user's touched."""
import hashlib
from pathlib import Path

import pytest

from conftest import run_cli


def assert_clean_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def tree_digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_unknown_method(tmp_path):
    assert_clean_error(run_cli("quantize", "--method", "foo", "--output", tmp_path / "o"), "unknown method 'foo'", "rtn")


def test_bits_5(tmp_path):
    assert_clean_error(run_cli("quantize", "--bits", "5", "--output", tmp_path / "o"), "unsupported bits 5")


def test_missing_model(tmp_path):
    assert_clean_error(run_cli("quantize", "--model", tmp_path / "nope", "--output", tmp_path / "o"), "does not exist")


def test_non_dividing_group_size(tmp_path, tiny_llama_dir):
    out = tmp_path / "o"
    assert_clean_error(run_cli("quantize", "--model", tiny_llama_dir, "--group-size", "128", "--output", out),
                       "group size 128 does not divide", "input size 64")
    assert not out.exists()


def test_non_empty_output_is_left_alone(tmp_path, tiny_llama_dir):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    before = tree_digest(out)
    assert_clean_error(run_cli("quantize", "--model", tiny_llama_dir, "--output", out), "not empty", "--overwrite")
    assert tree_digest(out) == before
    assert not any(p.name.startswith(".o.") for p in tmp_path.iterdir())


@pytest.mark.parametrize("content", ["", "just a few words\n"])
def test_empty_or_too_short_dataset(tmp_path, tiny_llama_dir, content):
    data = tmp_path / "d.txt"
    data.write_text(content)
    out = tmp_path / "o"
    proc = run_cli("quantize", "--model", tiny_llama_dir, "--method", "gptq", "--dataset", data, "--num-samples", "4",
                   "--seq-len", "64", "--output", out)
    assert_clean_error(proc, "empty" if not content else "has only")
    assert not out.exists()


def test_corrupt_safetensors(tmp_path, tiny_llama_dir):
    out = tmp_path / "q"
    ok = run_cli("quantize", "--model", tiny_llama_dir, "--output", out, "--json")
    assert ok.returncode == 0, ok.stderr[-2000:]
    shard = out / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated
    before = tree_digest(out)
    assert_clean_error(run_cli("eval", "--model", out, "--max-windows", "1", "--seq-len", "32"), "model.safetensors")
    assert tree_digest(out) == before
