"""Fuzz of the command line (#45): every command's options with invalid values, and every input kind
(safetensors shard, index, config, tokenizer, recipe YAML, GGUF, calibration files) damaged.

Each case must end the way a user-fixable error does: exit code 2, one `error:` line (at most
three lines on stderr, no traceback), no staging folder left beside the output, and nothing the
user had changed. Commands run in-process through `quantkit.cli.main`, which turns QuantkitError
and click's usage errors into exit 2: any other exception propagates into the test, so a traceback
cannot pass unseen.

The cases come from one catalogue in a fixed order; a seeded RNG picks the damage (offsets, bytes)
and, in the fast tier, a sample of about FAST_CASES of them (every command and input kind). The slow
tier runs the whole catalogue, each damaged input drawn SLOW_ROUNDS times. Seed and counts are
printed (`pytest -s`). A run of the whole catalogue once (seed 4546) took 517 s on a busy 2-core box.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import random
import shutil
import struct
import time
from pathlib import Path

import pytest

from quantkit.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = 4545
FAST_CASES = 40
SLOW_ROUNDS = 3
CAL = ["--method", "gptq", "--num-samples", "2", "--seq-len", "16"]  # a calibrating run, small


def run_main(argv) -> tuple[int, str]:
    """(exit code, stderr) of `quantkit ARGV` in this process. Anything but SystemExit propagates."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            main([str(a) for a in argv])
        except SystemExit as exc:
            return exc.code, err.getvalue()
    raise AssertionError("main returned without exiting")


def tree_digest(folder: Path) -> dict[str, str]:
    folder = Path(folder)
    if folder.is_file():
        return {folder.name: hashlib.sha256(folder.read_bytes()).hexdigest()}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_one_line_error(code, stderr: str, case: str) -> None:
    lines = [ln for ln in stderr.split("\n") if ln.strip()]  # a progress bar redrawn with \r is one line
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert code == 2, f"{case}: exit {code}\n{stderr[-1500:]}"
    assert "Traceback" not in stderr, f"{case}:\n{stderr[-1500:]}"
    assert len(errors) == 1 and len(lines) <= 3, f"{case}: {len(lines)} lines on stderr:\n{stderr[-1500:]}"


# ------------------------------------------------------------------ inputs to damage


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_llama_dir) -> dict[str, Path]:
    """The valid inputs every case starts from: the tiny source model (one file and sharded), a
    quantized checkpoint, a GGUF file, a recipe and calibration files."""
    import transformers

    work = tmp_path_factory.mktemp("fuzz-inputs")
    sharded = work / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.save_pretrained(sharded, max_shard_size="4MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_llama_dir / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    quantized, gguf = work / "quantized", work / "gguf"
    for argv in (["quantize", "--model", tiny_llama_dir, "--group-size", "32", "--output", quantized],
                 ["convert", "--model", tiny_llama_dir, "--format", "gguf", "--gguf-type", "F32", "--output", gguf]):
        code, err = run_main(argv)
        assert code == 0, err[-2000:]
    recipe = work / "recipe.yaml"
    recipe.write_text("method: gptq\nscheme:\n  bits: 4\n  group_size: 32\ncalibration:\n  num_samples: 2\n"
                      "  seq_len: 16\n")
    text = " ".join(f"word{i % 97} and more text {i}." for i in range(400))
    jsonl, txt, parquet = work / "cal.jsonl", work / "cal.txt", work / "cal.parquet"
    jsonl.write_text("".join(json.dumps({"text": text[i:i + 300]}) + "\n" for i in range(0, 3000, 300)))
    txt.write_text(text)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [text[i:i + 300] for i in range(0, 3000, 300)]}), parquet)
    return {"model": Path(tiny_llama_dir), "sharded": sharded, "quantized": quantized, "gguf": gguf / "model.gguf",
            "recipe": recipe, "jsonl": jsonl, "txt": txt, "parquet": parquet}


# ------------------------------------------------------------------ the catalogue
# A case is (name, make) where make(rng, inputs, work) returns the argv ("OUT" is the output path)
# after writing whatever damaged copy it needs under `work`.

def _option_cases():
    """Each command's options with invalid values: wrong types, out of range, empty, huge."""
    quantize = ["quantize", "--model", "{model}", "--output", "OUT"]
    table = [
        (quantize, {
            "--bits": ["abc", "", "1.5", "0", "-4", "5", "99999999999999999999"],
            "--group-size": ["abc", "", "0", "-5", "7", "3.5", "1000000000000"],
            "--method": ["", ",", "bogus", "awq,awq", "gptq,awq", "rtn,gptq"],
            "--format": ["bogus", ""],
            "--dtype": ["bogus", "", "int8"],
            "--device": ["bogus", "cuda", "cuda:7", "mps", "", "cpu:x"],
            "--max-shard-size": ["abc", "0", "-5GB", "", "5XB", "1e400GB", "0.0001KB"],
            "--nproc": ["0", "-1", "3", "abc"],
            "--dist-timeout": ["-1", "0", "nan", "inf", "abc"],
            "--device-map": ["bogus", ""],
            "--recipe": ["/nonexistent/recipe.yaml", "no-such-bundled-recipe"],
            "--ignore": ["[", "(unclosed"],
            "--model": ["", "/nonexistent/model"],
            "--moe-calibration": ["bogus"],
            "--target-bits": ["nan", "-1", "0", "abc", "inf"],
            "--target-size": ["abc", "0", "-1GB", ""],
        }),
        (quantize + ["--format", "gguf"], {"--gguf-type": ["Q9_9", "", "q4"]}),
        (quantize + ["--device-map", "auto"], {"--max-memory": ["garbage", "0=", "=5GiB", "cpu=-1GB"]}),
        (quantize + CAL, {
            "--num-samples": ["abc", "0", "-3", "1000000000"],
            "--seq-len": ["0", "1", "-1", "abc", "1000000000"],
            "--batch-size": ["0", "-2", "abc"],
            "--seed": ["abc", "1.5"],
            "--option": ["damp_percent=abc", "damp_percent=", "damp_percent=-1", "damp_percent=2", "block_size=0",
                         "block_size=abc", "desc_act=maybe", "bogus=1", "=1", "noequals", "gptaq_alpha=nan"],
            "--moe-min-tokens": ["-1", "0", "abc"],
            "--dataset": ["/nonexistent/cal.txt", "bogus", ""],
        }),
        (["convert", "--model", "{quantized}", "--output", "OUT"], {
            "--format": ["bogus", ""],
        }),
        (["convert", "--model", "{quantized}", "--output", "OUT", "--format", "gguf"], {
            "--gguf-type": ["bogus", "", "Q4_K"],
        }),
        (["eval", "--model", "{model}", "--max-windows", "1", "--seq-len", "16"], {
            "--seq-len": ["0", "1", "-5", "abc", "100000"],
            "--max-windows": ["0", "-1", "abc"],
            "--batch-size": ["0", "-1"],
            "--backend": ["bogus", ""],
            "--dtype": ["bogus"],
            "--device": ["cuda", "bogus"],
            "--dataset": ["bogus", "/nonexistent/eval.txt"],
            "--baseline": ["/nonexistent/model"],
        }),
        (["generate", "--model", "{model}", "--prompt", "hi", "--max-new-tokens", "2"], {
            "--max-new-tokens": ["0", "-1", "abc", "100000"],
            "--temperature": ["-1", "nan", "inf", "abc"],
            "--top-p": ["0", "2", "nan"],
            "--top-k": ["-2", "abc"],
            "--block-size": ["0", "-1"],
            "--kv-cache-dtype": ["bogus"],
            "--backend": ["bogus"],
            "--dtype": ["bogus"],
            "--device": ["cuda", "bogus"],
            "--draft": ["/nonexistent/model"],
            "--lm-head-quant": ["bogus"],
        }),
        (["generate", "--model", "{model}", "--prompt", "hi", "--max-new-tokens", "2", "--draft", "ngram"], {
            "--num-speculative-tokens": ["0", "-1"],
            "--draft-confidence": ["-1", "nan", "2"],
        }),
        (["bench", "--model", "{model}", "--input-len", "4", "--output-len", "2", "--batch-size", "1"], {
            "--batch-size": ["0", "-1"],
            "--input-len": ["0", "-1", "100000"],
            "--output-len": ["0", "-2"],
            "--block-size": ["0", "-1"],
            "--kv-cache-memory": ["0", "-5", "abc", "1KB"],
            "--device": ["cuda"],
            "--backend": ["bogus"],
            "--kv-cache-dtype": ["bogus"],
        }),
        (["inspect"], {"--model": ["/nonexistent/model", ""]}),
        (["sensitivity", "--model", "{model}", "--output", "OUT", "--num-samples", "2", "--seq-len", "16",
          "--eval-windows", "1", "--eval-seq-len", "16", "--sample", "1"], {
            "--candidate-bits": ["", "5", "abc", "4,,8"],
            "--eval-windows": ["0", "-1"],
            "--eval-seq-len": ["0", "1"],
            "--sample": ["-1"],
            "--num-samples": ["0"],
            "--seq-len": ["0"],
            "--method": ["bogus"],
            "--format": ["bogus"],
        }),
    ]
    for base, options in table:
        for option, values in options.items():
            for value in values:
                yield f"{base[0]} {option} {value!r}", (lambda rng, inp, work, base=base, option=option, value=value:
                                                       [_fill(a, inp) for a in base] + [option, _fill(value, inp)])


def _fill(arg, inp) -> str:
    arg = str(arg)
    return str(inp[arg[1:-1]]) if arg.startswith("{") and arg.endswith("}") else arg


def _copy(src: Path, work: Path, name: str) -> Path:
    dst = work / name
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copyfile(src, dst)
    return dst


def _shard_damage(rng: random.Random, path: Path, how: str) -> None:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    if how == "truncate":
        cut = rng.choice([0, rng.randrange(1, 8), rng.randrange(8, 8 + n), rng.randrange(8 + n, len(raw))])
        path.write_bytes(raw[:cut])
        return
    if how == "header-length":
        path.write_bytes(struct.pack("<Q", rng.choice([n + 4096, 2**40, 2**63 + 5, 3])) + raw[8:])
        return
    if how == "header-garbage":
        path.write_bytes(raw[:8] + bytes(rng.randrange(256) for _ in range(n)) + raw[8 + n:])
        return
    key = rng.choice(sorted(k for k in header if k != "__metadata__"))
    entry = header[key]
    if how == "offset-past-end":
        entry["data_offsets"] = [entry["data_offsets"][0], len(raw) - 8 - n + rng.choice([8, 4096, 2**40])]
    elif how == "dtype-lie":
        entry["dtype"] = rng.choice([d for d in ("F16", "I64", "U8", "F64") if d != entry["dtype"]])
    elif how == "shape-lie":
        entry["shape"] = [d * 2 for d in entry["shape"]] or [2]
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def _edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _input_cases():
    """Every input kind, damaged; the command that reads it."""
    quantize = lambda folder, *extra: ["quantize", "--model", folder, "--output", "OUT", *extra]  # noqa: E731

    for how in ("truncate", "header-length", "header-garbage", "offset-past-end", "dtype-lie", "shape-lie"):
        def make(rng, inp, work, how=how):
            folder = _copy(inp["model"], work, "model")
            _shard_damage(rng, folder / "model.safetensors", how)
            return quantize(folder)
        yield f"source shard {how}", make

        def make_sharded(rng, inp, work, how=how):
            folder = _copy(inp["sharded"], work, "sharded")
            _shard_damage(rng, rng.choice(sorted(folder.glob("model-*.safetensors"))), how)
            return quantize(folder)
        yield f"sharded source shard {how}", make_sharded

        def make_quantized(rng, inp, work, how=how):
            folder = _copy(inp["quantized"], work, "quantized")
            _shard_damage(rng, folder / "model.safetensors", how)
            command = rng.choice([["inspect", folder], ["convert", folder, "--format", "awq", "--output", "OUT"],
                                  ["eval", "--model", folder, "--seq-len", "16", "--max-windows", "1"]])
            return command
        yield f"quantized shard {how}", make_quantized

    index_edits = {
        "no weight_map": lambda d: d.pop("weight_map"),
        "weight_map a list": lambda d: d.update(weight_map=[1, 2]),
        "weight_map values not strings": lambda d: d.update(weight_map={k: 5 for k in d["weight_map"]}),
        "missing shard named": lambda d: d["weight_map"].update({next(iter(d["weight_map"])): "model-09-of-09.safetensors"}),
        "not an object": None,
    }
    for name, edit in index_edits.items():
        def make(rng, inp, work, edit=edit):
            folder = _copy(inp["sharded"], work, "sharded")
            index = folder / "model.safetensors.index.json"
            if edit is None:
                index.write_text(rng.choice(["[1, 2]", "{not json", "", "null"]))
            else:
                _edit_json(index, edit)
            return quantize(folder)
        yield f"index {name}", make

    config_edits = {
        "garbage": b"{not json", "empty": b"", "a list": b"[1, 2]", "null": b"null", "binary": b"\xff\xfe\x00garbage",
        "no model_type": {"model_type": None}, "bogus model_type": {"model_type": "bogus"},
        "hidden_size disagrees with weights": {"hidden_size": 128},
        "hidden_size a string": {"hidden_size": "64"}, "hidden_size zero": {"hidden_size": 0},
        "vocab_size disagrees with weights": {"vocab_size": 1000},
        "more layers than weights": {"num_hidden_layers": 3},
        "heads do not divide hidden": {"num_attention_heads": 3},
        "kv heads do not divide heads": {"num_key_value_heads": 3},
        "intermediate_size disagrees": {"intermediate_size": 256},
        "negative layers": {"num_hidden_layers": -1},
    }
    for name, edit in config_edits.items():
        def make(rng, inp, work, edit=edit):
            folder = _copy(inp["model"], work, "model")
            if isinstance(edit, bytes):
                (folder / "config.json").write_bytes(edit)
            else:
                _edit_json(folder / "config.json", lambda d: d.update(edit))
            return quantize(folder, *rng.choice([[], CAL]))
        yield f"config {name}", make

    def tokenizer_smaller_than_config(rng, inp, work):
        """config and weights say 49152 tokens; the tokenizer is fine. Then the weights say 256: the
        tokenizer's ids run past the embedding."""
        import torch
        import transformers

        folder = work / "small-vocab"
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
                                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(inp["model"] / name, folder / name)
        return rng.choice([quantize(folder, *CAL), ["eval", "--model", folder, "--seq-len", "16", "--max-windows", "1"],
                           ["generate", "--model", folder, "--prompt", "a longer prompt with words", "--max-new-tokens", "2"]])
    yield "tokenizer vocabulary larger than the model's", tokenizer_smaller_than_config

    tokenizer_edits = {
        "tokenizer.json garbage": ("tokenizer.json", b"{not json"),
        "tokenizer.json truncated": ("tokenizer.json", None),
        "tokenizer.json empty": ("tokenizer.json", b""),
        "tokenizer_config.json garbage": ("tokenizer_config.json", b"[1, 2"),
        "tokenizer_config.json a list": ("tokenizer_config.json", b"[1, 2]"),
        "tokenizer files missing": ("tokenizer.json", "remove"),
    }
    for name, (file, content) in tokenizer_edits.items():
        def make(rng, inp, work, file=file, content=content):
            folder = _copy(inp["model"], work, "model")
            path = folder / file
            if content == "remove":
                path.unlink()
                (folder / "tokenizer_config.json").unlink()
            elif content is None:
                raw = path.read_bytes()
                path.write_bytes(raw[:rng.randrange(1, len(raw) - 1)])
            else:
                path.write_bytes(content)
            return rng.choice([quantize(folder, *CAL), ["eval", "--model", folder, "--seq-len", "16", "--max-windows", "1"]])
        yield f"tokenizer {name}", make

    recipes = {
        "garbage": "method: [unclosed\n", "a list": "- 1\n- 2\n", "a scalar": "gptq\n", "empty": "",
        "unknown key": "method: gptq\nbogus: 1\n", "unknown scheme key": "method: rtn\nscheme:\n  bitz: 4\n",
        "bits a word": "method: rtn\nscheme:\n  bits: four\n", "bits a list": "method: rtn\nscheme:\n  bits: [4]\n",
        "method a number": "method: 5\n", "scheme a list": "method: rtn\nscheme: [1, 2]\n",
        "options not a mapping": "method: gptq\noptions: x\n", "option of wrong type": "method: gptq\noptions:\n  damp_percent: abc\n",
        "unknown option": "method: gptq\noptions:\n  bogus: 1\n",
        "calibration wrong type": "method: gptq\ncalibration:\n  num_samples: many\n",
        "calibration zero": "method: gptq\ncalibration:\n  num_samples: 0\n",
        "binary": "\x00\x01\x02",
    }
    for name, text in recipes.items():
        def make(rng, inp, work, text=text):
            path = work / "recipe.yaml"
            path.write_text(text)
            return quantize(inp["model"], "--recipe", path)
        yield f"recipe {name}", make

    gguf_damage = ("truncate", "bad magic", "version", "tensor count huge", "kv count huge", "empty")
    for how in gguf_damage:
        def make(rng, inp, work, how=how):
            path = _copy(inp["gguf"], work, "model.gguf")
            raw = bytearray(path.read_bytes())
            if how == "truncate":
                raw = raw[:rng.randrange(4, len(raw) - 1)]
            elif how == "bad magic":
                raw[:4] = b"GGUX"
            elif how == "version":
                raw[4:8] = struct.pack("<I", rng.choice([0, 1, 99]))
            elif how == "tensor count huge":
                raw[8:16] = struct.pack("<Q", 2**40)
            elif how == "kv count huge":
                raw[16:24] = struct.pack("<Q", 2**40)
            else:
                raw = bytearray()
            path.write_bytes(bytes(raw))
            return rng.choice([quantize(path), ["eval", "--model", path, "--seq-len", "16", "--max-windows", "1"]])
        yield f"gguf {how}", make

    calibration = {
        "jsonl bad line": ("jsonl", lambda raw, rng: raw + b"{not json\n"),
        "jsonl rows not objects": ("jsonl", lambda raw, rng: b"[1, 2]\n5\n\"x\"\n"),
        "jsonl no text field": ("jsonl", lambda raw, rng: b'{"other": "x"}\n' * 5),
        "jsonl text not a string": ("jsonl", lambda raw, rng: b'{"text": 5}\n{"text": null}\n'),
        "jsonl binary": ("jsonl", lambda raw, rng: bytes(rng.randrange(256) for _ in range(2000))),
        "txt binary": ("txt", lambda raw, rng: bytes(rng.randrange(256) for _ in range(2000))),
        "txt empty": ("txt", lambda raw, rng: b""),
        "parquet truncated": ("parquet", lambda raw, rng: raw[:rng.randrange(1, len(raw) - 1)]),
        "parquet garbage": ("parquet", lambda raw, rng: b"PAR1" + bytes(rng.randrange(256) for _ in range(500)) + b"PAR1"),
        "json garbage": ("json", lambda raw, rng: b"{\"text\": [1, "),
        "json wrong shape": ("json", lambda raw, rng: b"{\"rows\": 5}"),
    }
    for name, (kind, damage) in calibration.items():
        def make(rng, inp, work, kind=kind, damage=damage):
            src = inp["jsonl" if kind == "json" else kind]
            path = work / f"cal.{kind}"
            path.write_bytes(damage(src.read_bytes(), rng))
            return quantize(inp["model"], *CAL, "--dataset", path)
        yield f"calibration {name}", make

    def output_is_a_file(rng, inp, work):
        (work / "taken").write_text("precious")
        return ["quantize", "--model", inp["model"], "--output", work / "taken"]
    yield "output is a file", output_is_a_file


def catalogue() -> list[tuple[str, object]]:
    return list(_option_cases()) + list(_input_cases())


def run_case(name: str, make, rng: random.Random, inputs: dict, work: Path) -> None:
    work.mkdir()
    argv = make(rng, inputs, work)
    out = work / "out"
    argv = [str(out) if a == "OUT" else a for a in argv]
    before_inputs = {k: tree_digest(v) for k, v in inputs.items()}
    before_work = tree_digest(work)
    listed = sorted(p.name for p in work.iterdir())
    code, stderr = run_main(argv)
    assert_one_line_error(code, stderr, f"{name}: {' '.join(map(str, argv))}")
    assert sorted(p.name for p in work.iterdir()) == listed, f"{name}: left {sorted(p.name for p in work.iterdir())}"
    assert tree_digest(work) == before_work, f"{name}: changed a file it was given"
    assert {k: tree_digest(v) for k, v in inputs.items()} == before_inputs, f"{name}: changed a shared input"


def _run(cases, inputs, tmp_path, seed) -> None:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    failures = []
    slowest = []
    for i, (name, make) in enumerate(cases):
        t_case = time.perf_counter()
        try:
            run_case(name, make, rng, inputs, tmp_path / f"case-{i:04d}")
        except Exception as exc:  # noqa: BLE001 - collected, so one run reports every failing case
            import traceback

            failures.append(f"--- {name}\n{''.join(traceback.format_exception(exc))[-1500:]}")
            print(f"FAILED {name}: {type(exc).__name__} {str(exc).strip().splitlines()[-1][:300]}", flush=True)
        slowest.append((time.perf_counter() - t_case, name))
    print(f"\nfuzz seed {seed}: {len(cases)} cases in {time.perf_counter() - t0:.1f} s, {len(failures)} failed")
    print("slowest: " + "; ".join(f"{name} {t:.1f} s" for t, name in sorted(slowest, reverse=True)[:8]))
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)[:20000]


def test_fuzz_fast(inputs, tmp_path):
    """FAST_CASES cases drawn (seed SEED) from the catalogue, every command and input kind represented."""
    cases = catalogue()
    rng = random.Random(SEED)
    groups: dict[str, list[int]] = {}
    for i, (name, _) in enumerate(cases):
        groups.setdefault(name.split()[0], []).append(i)
    share = FAST_CASES / len(cases)
    picked = sorted(i for members in groups.values() for i in rng.sample(members, max(1, round(share * len(members)))))
    _run([cases[i] for i in picked], inputs, tmp_path, SEED)


@pytest.mark.slow
def test_fuzz_whole_catalogue(inputs, tmp_path):
    """Every case of the catalogue; the damaged inputs SLOW_ROUNDS times, each with its own random damage
    (the option cases draw nothing at random)."""
    cases = list(_option_cases()) + list(_input_cases()) * SLOW_ROUNDS
    only = __import__("os").environ.get("QK_FUZZ_ONLY")  # a debugging aid: cases whose name has this text
    _run([c for c in cases if only is None or __import__("re").match(only, c[0])], inputs, tmp_path, SEED + 1)


# ------------------------------------------------------------------ file-system faults (injected, no root needed)


def _failing_after(original, n_tensors: int, err: int):
    """`write_safetensors` that writes `n_tensors` tensors of a file, then fails like a full or read-only disk."""
    import errno as _errno
    import os

    def write(path, layout, load, **kw):
        count = {"n": 0}

        def load_then_fail(name):
            count["n"] += 1
            if count["n"] > n_tensors:
                raise OSError(err, os.strerror(err), str(path))
            return load(name)

        return original(path, layout, load_then_fail, **kw)

    assert err in (_errno.ENOSPC, _errno.EROFS)
    return write


def test_disk_full_during_the_final_write_keeps_progress_and_resume_finishes_byte_identical(tmp_path, monkeypatch,
                                                                                              tiny_llama_dir):
    import errno

    from quantkit import checkpoint

    clean, out = tmp_path / "clean", tmp_path / "out"
    argv = ["quantize", "--model", tiny_llama_dir, "--group-size", "32", "--max-shard-size", "2MB"]
    assert run_main([*argv, "--output", clean])[0] == 0
    monkeypatch.setattr(checkpoint, "write_safetensors", _failing_after(checkpoint.write_safetensors, 3, errno.ENOSPC))
    code, stderr = run_main([*argv, "--output", out])
    assert_one_line_error(code, stderr, "disk full")
    assert "no space left" in stderr and "needs about" in stderr and "--resume" in stderr, stderr
    assert not out.exists()
    stage = checkpoint.staging_dir(out)
    assert (stage / "layers").is_dir(), sorted(p.name for p in stage.iterdir())  # the finished layers are kept
    monkeypatch.undo()  # space freed
    code, stderr = run_main([*argv, "--output", out, "--resume"])
    assert code == 0, stderr[-2000:]
    assert not stage.exists()
    assert tree_digest(out) == tree_digest(clean)


def _disk_full_after_first_layer(monkeypatch) -> None:
    """Every progress record after the first fails as a full disk does (ENOSPC), until monkeypatch.undo()."""
    import errno
    import os

    from quantkit.progress import ProgressStore

    save = ProgressStore.save_layer

    def save_first_only(self, record):
        if list(self.done_layers()):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.folder / "layers"))
        save(self, record)

    monkeypatch.setattr(ProgressStore, "save_layer", save_first_only)


def test_disk_full_while_calibrating_names_resume(tmp_path, monkeypatch, tiny_llama_dir):
    clean, out = tmp_path / "clean", tmp_path / "out"
    argv = ["quantize", "--model", tiny_llama_dir, *CAL]
    assert run_main([*argv, "--output", clean])[0] == 0
    _disk_full_after_first_layer(monkeypatch)
    code, stderr = run_main([*argv, "--output", out])
    assert_one_line_error(code, stderr, "disk full while calibrating")
    assert "no space left" in stderr and "--resume" in stderr, stderr
    monkeypatch.undo()
    code, stderr = run_main([*argv, "--output", out, "--resume"])
    assert code == 0, stderr[-2000:]
    assert tree_digest(out) == tree_digest(clean)


def test_disk_full_in_a_float_run_names_resume_and_resume_finishes_byte_identical(tmp_path, monkeypatch,
                                                                                  tiny_llama_dir):
    """--scheme NVFP4A16 with GPTQ: the disk fills after layer 0's record; one line naming --resume, and the
    resumed run writes the uninterrupted bytes. Round-to-nearest (no layers): the same one line, nothing left."""
    clean, out = tmp_path / "clean", tmp_path / "out"
    argv = ["quantize", "--model", tiny_llama_dir, "--scheme", "NVFP4A16", *CAL]
    assert run_main([*argv, "--output", clean])[0] == 0
    _disk_full_after_first_layer(monkeypatch)
    code, stderr = run_main([*argv, "--output", out])
    assert_one_line_error(code, stderr, "float disk full while calibrating")
    assert "no space left" in stderr and "--resume" in stderr, stderr
    assert not out.exists() and not (tmp_path / ".out.float-partial").exists()
    monkeypatch.undo()
    code, stderr = run_main([*argv, "--output", out, "--resume"])
    assert code == 0, stderr[-2000:]
    assert tree_digest(out) == tree_digest(clean)

    import errno
    import os

    from quantkit import float_checkpoint

    def full_disk(*args, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "rtn"))

    monkeypatch.setattr(float_checkpoint, "_save", full_disk)
    code, stderr = run_main(["quantize", "--model", tiny_llama_dir, "--scheme", "FP8_DYNAMIC", "--output",
                             tmp_path / "rtn"])
    assert_one_line_error(code, stderr, "float rtn disk full")
    assert "no space left" in stderr and "--resume" not in stderr, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clean", "out"]


def test_read_only_output_location_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, tiny_llama_dir):
    """A read-only disk (EROFS) where the output goes: refused in one line, nothing created there."""
    import errno
    import os

    work = tmp_path / "readonly"
    work.mkdir()
    mkdir = os.mkdir

    def read_only_mkdir(path, *args, **kw):
        if str(path).startswith(str(work)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return mkdir(path, *args, **kw)

    monkeypatch.setattr(os, "mkdir", read_only_mkdir)
    code, stderr = run_main(["quantize", "--model", tiny_llama_dir, "--output", work / "out"])
    assert_one_line_error(code, stderr, "read-only")
    assert "cannot write" in stderr and "--output" in stderr, stderr
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("err", ["ENOSPC", "EROFS"])
def test_convert_write_failure_leaves_nothing_half_written(tmp_path, monkeypatch, inputs, err):
    import errno

    from quantkit import convert

    out = tmp_path / "out"
    monkeypatch.setattr(convert, "write_safetensors", _failing_after(convert.write_safetensors, 2, getattr(errno, err)))
    code, stderr = run_main(["convert", "--model", inputs["quantized"], "--format", "compressed-tensors", "--output", out])
    assert_one_line_error(code, stderr, f"convert {err}")
    assert ("no space left" if err == "ENOSPC" else "cannot write") in stderr, stderr
    assert list(tmp_path.iterdir()) == []
