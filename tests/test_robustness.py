"""Surviving the real world: interrupted runs resume to identical bytes, identical inputs give
identical bytes, streaming keeps host memory bounded, hostile checkpoints fail cleanly, and
numerically hostile calibration never produces NaN weights."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import multiprocessing
import os
import pickle
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import pytest
import torch

from conftest import last_json, run_cli

REPO = Path(__file__).resolve().parents[1]


def _bench_streaming():
    spec = importlib.util.spec_from_file_location("bench_streaming", REPO / "scripts" / "bench_streaming.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench_streaming()


def tree_sha256(folder: Path) -> dict[str, str]:
    return bench.tree_sha256(folder)


def assert_clean_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for n in needles:
        assert n in lines[0], lines[0]


def cli_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "quantkit.cli", *map(str, args)]


def interrupt_after_layer(args: list, output: Path, layer: int, sig: int, timeout: float = 900) -> subprocess.Popen:
    """Start `quantkit quantize ARGS --output OUTPUT`, wait until the staging folder holds the
    progress record of `layer`, then send `sig` to the real process and wait for it to end."""
    staging = output.parent / f".{output.name}.partial"
    record = staging / "layers" / f"layer-{layer:05d}.safetensors"
    # a suite started in the background (`pytest &` from a script) inherits SIGINT as ignored, and
    # Python then installs no KeyboardInterrupt handler: give the child the default disposition
    proc = subprocess.Popen(cli_cmd("quantize", *args, "--output", output), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + timeout
    try:
        while not record.exists():
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"quantize ended ({proc.returncode}) before layer {layer} finished:\n{err[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"layer {layer} did not finish within {timeout} s")
            time.sleep(0.002)
        proc.send_signal(sig)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert not output.exists(), "an interrupted run must not leave an output folder"
    done = sorted(staging.glob("layers/layer-*.safetensors"))
    assert len(done) > layer, done
    return proc


# ------------------------------------------------------------------ resume + determinism (demo)

@pytest.mark.slow
def test_demo_resume_after_sigint_is_byte_identical_and_runs_are_deterministic(tmp_path):
    from quantkit import __version__

    args = ["--method", "rtn", "--bits", "4", "--json"]  # RTN reads no calibration data (a --seed is refused)
    ref, again, out = tmp_path / "ref", tmp_path / "again", tmp_path / "out"
    proc = run_cli("quantize", *args, "--output", ref)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_json(proc.stdout)["quantized_linears"] == 30 * 7
    reference = tree_sha256(ref)
    assert "model.safetensors" in reference and "config.json" in reference

    # determinism: same model and recipe -> the same bytes, file by file
    proc = run_cli("quantize", *args, "--output", again)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tree_sha256(again) == reference
    card = (ref / "README.md").read_text()
    assert "- seed:" not in card and f"quantkit {__version__}" in card

    # Ctrl-C (a real SIGINT to the real CLI) once layer 3 is on disk
    staging = tmp_path / ".out.partial"
    killed = interrupt_after_layer(args, out, layer=3, sig=signal.SIGINT)
    assert killed.returncode == 130, (killed.returncode, killed.stderr[-2000:])
    n_done = len(list(staging.glob("layers/layer-*.safetensors")))
    assert n_done < 30, "the run finished before the interrupt: nothing was resumed"

    # the same command without --resume: a clear error, the partial folder untouched
    before = tree_sha256(staging)
    assert_clean_error(run_cli("quantize", *args, "--output", out), str(staging), "--resume")
    assert tree_sha256(staging) == before and not out.exists()

    # --resume continues from the records and writes exactly the uninterrupted bytes
    proc = run_cli("quantize", *args, "--output", out, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tree_sha256(out) == reference
    assert not staging.exists()


# ------------------------------------------------------------------ resume with calibration replay (gptq)

def random_llama_with_demo_tokenizer(tmp_path_factory, name: str, **shape) -> Path:
    """A random Llama on disk with the demo tokenizer (so calibration token ids fit the embedding)."""
    from quantkit.assets import demo_model_dir

    out = tmp_path_factory.mktemp(name)
    bench.make_random_llama(out, heads=4, kv_heads=2, vocab=49152, tokenizer_from=Path(demo_model_dir()), **shape)
    return out


@pytest.fixture(scope="module")
def small_llama_dir(tmp_path_factory) -> Path:
    """6 random layers in 2 shards."""
    return random_llama_with_demo_tokenizer(tmp_path_factory, "small-llama", layers=6, hidden=128, intermediate=384,
                                            layers_per_shard=3, seed=1)


@pytest.mark.slow  # five CLI runs, one killed mid-way
def test_gptq_deterministic_and_resume_after_sigkill_replays_calibration(tmp_path, small_llama_dir):
    """GPTQ with calibration: two runs give the same bytes; a SIGKILLed run resumed (the finished
    layers restored, the calibration activations replayed through them) gives them too."""
    args = ["--model", small_llama_dir, "--method", "gptq", "--group-size", "32", "--num-samples", "8",
            "--seq-len", "64", "--seed", "3", "--json"]
    ref, again, out = tmp_path / "ref", tmp_path / "again", tmp_path / "out"
    for folder in (ref, again):
        proc = run_cli("quantize", *args, "--output", folder)
        assert proc.returncode == 0, proc.stderr[-3000:]
    reference = tree_sha256(ref)
    assert tree_sha256(again) == reference
    assert "- seed: `3`" in (ref / "README.md").read_text()

    staging = tmp_path / ".out.partial"
    killed = interrupt_after_layer(args, out, layer=1, sig=signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    assert len(list(staging.glob("layers/layer-*.safetensors"))) < 6, "finished before the kill"

    # a resume with different settings is refused, the records untouched
    before = tree_sha256(staging)
    other = [a if a != "3" else "5" for a in args]  # --seed 5: other calibration samples
    assert_clean_error(run_cli("quantize", *other, "--output", out, "--resume"), "different settings",
                       "calibration_digest")
    assert tree_sha256(staging) == before

    proc = run_cli("quantize", *args, "--output", out, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tree_sha256(out) == reference and not staging.exists()


# ------------------------------------------------------------------ whole-model runs: finished layers let go

def test_quantize_releases_each_finished_layer_to_the_same_records(tmp_path, small_llama_dir):
    """`quantize` writes the checkpoint from the progress store, so once a layer's record is saved
    its weights are dropped (`release_layers`): the layers end on the meta device, and the records
    are exactly those of a run that keeps the model (fake-quantized) in memory."""
    from quantkit.api import linear_shapes
    from quantkit.pipeline import quantize_model
    from quantkit.models import get_adapter
    from quantkit.progress import ProgressStore
    from quantkit.quantizers.base import get_quantizer
    from quantkit.scheme import QuantScheme
    from quantkit.sources import load_source_model

    ids = torch.randint(0, 1000, (4, 32), generator=torch.Generator().manual_seed(2))
    stores = {}
    for release in (False, True):
        model, *_ = load_source_model(str(small_llama_dir), dtype=None)
        schemes = QuantScheme(bits=4, group_size=32).resolve(linear_shapes(model))
        store = stores[release] = ProgressStore(tmp_path / f"release-{release}")
        store.start({"run": "test"}, resume=False)
        quantize_model(model, get_adapter(model), get_quantizer("gptq"), schemes, ids, batch_size=4, progress=False,
                       store=store, release_layers=release)
        devices = {p.device.type for layer in get_adapter(model).decoder_layers(model) for p in layer.parameters()}
        assert devices == ({"meta"} if release else {"cpu"}), devices
    assert stores[True].done_layers() == stores[False].done_layers() == list(range(6))
    for index in range(6):
        kept, released = stores[False].load_layer(index), stores[True].load_layer(index)
        assert sorted(kept.quantized) == sorted(released.quantized)
        for name, qw in kept.quantized.items():
            for field in ("qweight", "scales", "zeros"):
                assert torch.equal(getattr(qw, field), getattr(released.quantized[name], field)), (index, name, field)
        assert sorted(kept.other) == sorted(released.other)
        assert all(torch.equal(kept.other[k], released.other[k]) for k in kept.other)


def _rss_file_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads Linux's /proc")
def test_page_out_hands_a_file_mappings_pages_back_and_keeps_its_contents(tmp_path):
    """What `_release_layer` relies on: a weight viewing a file mapping stays resident once read,
    until its pages are paged out; paging out keeps the contents (a later read faults them back
    in from the file) and leaves heap memory alone."""
    import mmap

    from quantkit.memory import page_out_file_backed

    path = tmp_path / "weights.bin"
    data = torch.arange(16 << 20, dtype=torch.int32)  # 64 MiB
    path.write_bytes(data.numpy().tobytes())
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)
    viewed = torch.frombuffer(mapping, dtype=torch.int32)
    heap = data.clone()
    base = _rss_file_kb()
    assert torch.equal(viewed, data)  # every page read, so resident
    read = _rss_file_kb() - base
    assert read > 48 << 10, read
    advised = page_out_file_backed([(viewed.data_ptr(), viewed.numel() * 4), (heap.data_ptr(), heap.numel() * 4)])
    if advised == 0:
        pytest.skip("this kernel has no MADV_PAGEOUT")
    assert advised == 64 << 20  # the mapping only: the heap tensor is not file-backed
    assert _rss_file_kb() - base < read // 4
    assert torch.equal(viewed, data) and torch.equal(heap, data)
    del viewed
    mapping.close()


# ------------------------------------------------------------------ streaming: bounded host memory

def test_peak_rss_of_a_child_is_its_own_not_its_big_parents():
    """`quantize --json` reports the peak of its own process, even when started by a big parent.

    ru_maxrss of a vforked child inherits the parent's high-water mark at exec: CI's pytest (4.3 GB
    by then) made the 0.8 GB streaming run report 4.3 GB."""
    parent = ("import subprocess, sys\n"
              "big = bytearray(1536 * 2**20)\n"
              "big[::4096] = b'\\x01' * len(big[::4096])\n"
              "child = 'from quantkit.api import peak_rss_mb; print(peak_rss_mb())'\n"
              "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True, check=True).stdout)\n")
    proc = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    child_peak_mb = float(proc.stdout.strip().splitlines()[-1])
    assert 0 < child_peak_mb < 1000, child_peak_mb


@pytest.mark.slow
def test_streaming_peak_rss_is_bounded_and_output_matches_whole_model(tmp_path_factory):
    """A ~2.5 GB fp32 model quantizes with peak RSS under half of its weights, to the same bytes.
    Measured (peak RSS is VmHWM, which counts the file pages the safetensors mmap faults in, so it
    moves with the page cache's state): 32 % (758 MB) on a warm machine and 40.6 % (962 MB) and
    45.1 % (1068 MB) in clean-clone CI runs (2026-12-01, 2026-12-05); the whole-model run measured
    33-37 % in the same runs (it also reads the file through the mmap layer by layer), so the bound
    guards streaming against holding the weights, not against the whole-model path."""
    from quantkit.assets import demo_model_dir

    work = tmp_path_factory.mktemp("streaming")
    try:
        model = work / "model"
        weights = bench.make_random_llama(model, layers=34, tokenizer_from=Path(demo_model_dir()))
        assert weights > 2.4e9
        stream = bench.quantize_cli(model, work / "stream", "--method", "rtn", "--streaming")
        whole = bench.quantize_cli(model, work / "whole", "--method", "rtn", "--no-streaming")
        print(f"\nstreaming: weights {weights / 2**20:.0f} MB; peak RSS streaming {stream['peak_rss_mb']:.0f} MB "
              f"({stream['peak_rss_mb'] * 2**20 / weights:.0%}) in {stream['wall_s']:.0f} s, whole-model "
              f"{whole['peak_rss_mb']:.0f} MB ({whole['peak_rss_mb'] * 2**20 / weights:.0%}) in {whole['wall_s']:.0f} s")
        assert stream["streaming"] is True and whole["streaming"] is False
        assert stream["peak_rss_mb"] * 2**20 < 0.5 * weights, stream
        assert tree_sha256(work / "stream") == tree_sha256(work / "whole")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------ hostile checkpoints (fuzz)

FUZZ_TIMEOUT_S = 20
FUZZ_WORKERS = 2
FIXED_INPUT = [[1, 5, 17, 99, 200, 3, 42, 7]]


def _tiny_model(folder: Path, demo_dir: Path, vocab: int = 256) -> Path:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=128,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(demo_dir).save_pretrained(folder)
    return folder


def _read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_with_header(path: Path, header: dict, data: bytes, pad: bool = True) -> None:
    blob = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


class _Evil:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _variants(base: Path, work: Path, rng: random.Random, marker: Path, full: bool = True):
    """Yield (name, folder) for corrupted copies of the checkpoint folder `base`; `full=False` runs
    fewer random cases and skips the format-independent ones (model config, garbage, pickles)."""
    files = sorted(p.name for p in base.iterdir() if p.suffix == ".safetensors")
    config = json.loads((base / "config.json").read_text())
    count = 0

    def fresh(kind: str) -> Path:
        nonlocal count
        count += 1
        folder = work / f"{base.name}-{count:03d}-{kind}"
        folder.mkdir()
        for p in base.iterdir():
            if p.suffix in (".safetensors", ".json"):
                shutil.copyfile(p, folder / p.name)
        return folder

    for _ in range(14 if full else 4):  # truncations: empty, inside the length, inside the header, inside the data
        f = fresh("truncate")
        target = f / rng.choice(files)
        raw = target.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        cut = rng.choice([0, rng.randrange(1, 8), rng.randrange(8, 8 + n), rng.randrange(8 + n, len(raw))])
        target.write_bytes(raw[:cut])
        yield "truncate", f
    for region in ("header", "data", "length"):
        for _ in range({"header": 30, "data": 30, "length": 6}[region] // (1 if full else 5)):
            f = fresh(f"flip-{region}")
            target = f / rng.choice(files)
            raw = bytearray(target.read_bytes())
            n = struct.unpack("<Q", raw[:8])[0]
            lo, hi = {"header": (8, 8 + n), "data": (8 + n, len(raw)), "length": (0, 8)}[region]
            for _ in range(rng.choice([1, 1, 2, 3])):
                pos = rng.randrange(lo, hi)
                raw[pos] ^= 1 << rng.randrange(8)
            target.write_bytes(bytes(raw))
            yield f"flip-{region}", f
    header_edits = ["shape_scale", "shape_extra_dim", "shape_swap", "shape_huge", "shape_negative", "offset_shift",
                    "offset_overlap", "offset_beyond", "offset_huge", "dtype", "dtype_bogus", "rename", "drop_entry",
                    "length_lies", "no_padding", "metadata_garbage"]
    for i in range(48 if full else 16):
        edit = header_edits[i % len(header_edits)]
        f = fresh(f"header-{edit}")
        target = f / rng.choice(files)
        header, data = _read_header(target)
        names = [k for k in header if k != "__metadata__"]
        key = rng.choice(names)
        entry = header[key]
        pad = True
        if edit == "shape_scale":
            entry["shape"] = [d * rng.choice([2, 4]) for d in entry["shape"]] or [2]
        elif edit == "shape_extra_dim":
            entry["shape"] = entry["shape"] + [1] if rng.random() < 0.5 else [1] + entry["shape"]
        elif edit == "shape_swap":
            entry["shape"] = list(reversed(entry["shape"])) if len(entry["shape"]) > 1 else entry["shape"] + [1]
        elif edit == "shape_huge":
            entry["shape"] = [2**40, 2**30]
        elif edit == "shape_negative":
            entry["shape"] = [-1] + entry["shape"][1:]
        elif edit == "offset_shift":
            a, b = entry["data_offsets"]
            entry["data_offsets"] = [a + 4, b + 4]
        elif edit == "offset_overlap":
            other = header[rng.choice(names)]
            entry["data_offsets"] = list(other["data_offsets"])
        elif edit == "offset_beyond":
            a, b = entry["data_offsets"]
            entry["data_offsets"] = [a, len(data) + 64]
        elif edit == "offset_huge":
            entry["data_offsets"] = [0, 2**62]
        elif edit == "dtype":  # a same-size or different-size lie, e.g. F16 <-> BF16, I32 -> F32
            entry["dtype"] = rng.choice([d for d in ("F16", "BF16", "F32", "I32", "I64", "U8", "I8", "F64", "BOOL")
                                         if d != entry["dtype"]])
        elif edit == "dtype_bogus":
            entry["dtype"] = rng.choice(["Q4", "", 7, None])
        elif edit == "rename":
            header[key + ".x"] = header.pop(key)
        elif edit == "drop_entry":
            del header[key]
        elif edit == "length_lies":
            blob = json.dumps(header, separators=(",", ":")).encode()
            target.write_bytes(struct.pack("<Q", rng.choice([len(blob) + 1000, 2**40, 2**63 + 5, 3])) + blob + data)
            yield f"header-{edit}", f
            continue
        elif edit == "no_padding":
            pad = False
        elif edit == "metadata_garbage":
            header["__metadata__"] = rng.choice([{"format": 5}, [1, 2], "pt", {"format": {"x": 1}}])
        _write_with_header(target, header, data, pad=pad)
        yield f"header-{edit}", f
    # properly written files with missing or bad tensors
    from safetensors.torch import load_file, save_file

    def rewrite(f: Path, fn) -> None:
        for name in files:
            state = load_file(str(f / name))
            fn(state)
            save_file(state, str(f / name), metadata={"format": "pt"})

    all_keys = sorted({k for name in files for k in json.loads(
        (base / name).read_bytes()[8:8 + struct.unpack("<Q", (base / name).read_bytes()[:8])[0]]) if k != "__metadata__"})
    for key in rng.sample(all_keys, min(12 if full else 6, len(all_keys))):
        f = fresh("missing-tensor")
        rewrite(f, lambda s, key=key: s.pop(key, None))
        yield "missing-tensor", f
    value_edits = [("scales", "nan"), ("scales", "inf"), ("scales", "zero"), ("scales", "negative"), ("scales", "huge"),
                   ("g_idx", "range"), ("g_idx", "negative"), ("g_idx", "permute"), ("qweight", "random"),
                   ("qzeros", "random"), ("qweight", "int64"), ("scales", "fp32"), ("scales", "int"),
                   ("weight_packed", "random"), ("weight_scale", "nan"), ("weight_shape", "lie"),
                   ("embed_tokens.weight", "nan"), ("norm.weight", "inf"), ("embed_tokens.weight", "int")]
    for suffix, how in value_edits:
        candidates = [k for k in all_keys if k.endswith(suffix)]
        if not candidates:
            continue
        key = rng.choice(candidates)
        f = fresh(f"value-{suffix}-{how}")

        def edit(state, key=key, how=how):
            if key not in state:
                return
            t = state[key]
            if how == "nan":
                t.view(-1)[rng.randrange(t.numel())] = float("nan")
            elif how == "inf":
                t.view(-1)[rng.randrange(t.numel())] = float("inf")
            elif how == "zero":
                t.zero_()
            elif how == "negative":
                t.neg_()
            elif how == "huge":
                t.fill_(60000.0)
            elif how == "range":
                t.view(-1)[rng.randrange(t.numel())] = 10**6
            elif how == "permute":
                state[key] = t[torch.randperm(t.numel(), generator=torch.Generator().manual_seed(1))].contiguous()
            elif how == "random":
                state[key] = torch.randint(-2**31, 2**31 - 1, t.shape, dtype=torch.int64,
                                           generator=torch.Generator().manual_seed(rng.randrange(1 << 30))).to(t.dtype)
            elif how == "int64":
                state[key] = t.to(torch.int64)
            elif how == "fp32":
                state[key] = t.float()
            elif how == "int":
                state[key] = t.to(torch.int32)
            elif how == "lie":
                state[key] = t * 2

        rewrite(f, edit)
        yield f"value-{suffix}-{how}", f
    # config.json edits
    q = config.get("quantization_config", {})
    config_edits = [
        ("bits", 3), ("bits", 8), ("bits", 5), ("bits", "4"), ("bits", None), ("bits", -1), ("bits", 2**40),
        ("group_size", 32), ("group_size", 128), ("group_size", 0), ("group_size", 7), ("group_size", "64"),
        ("group_size", -1), ("quant_method", "awq"), ("quant_method", "compressed-tensors"), ("quant_method", "gptq"),
        ("quant_method", "bogus"), ("quant_method", None), ("quant_method", 5), ("sym", not q.get("sym", True)),
        ("desc_act", True), ("dynamic", [1]), ("dynamic", {"+:.*": {"bits": 8}}), ("modules_to_not_convert", 5),
        ("checkpoint_format", "gptq_v2"), ("format", "bogus"), ("config_groups", "x"), ("zero_point", "yes"),
        ("version", "exllama"),
    ]
    for key, value in config_edits:
        f = fresh("config-q")
        cfg = json.loads((f / "config.json").read_text())
        cfg["quantization_config"][key] = value
        (f / "config.json").write_text(json.dumps(cfg))
        yield f"config-q-{key}={value!r}", f
    model_edits = [] if not full else [("hidden_size", 128), ("hidden_size", 0), ("hidden_size", "64"), ("hidden_size", 10**9),
                   ("intermediate_size", 256), ("intermediate_size", 10**8), ("num_hidden_layers", 3),
                   ("num_hidden_layers", 1), ("num_hidden_layers", 10**7), ("num_attention_heads", 0),
                   ("num_attention_heads", 3), ("num_key_value_heads", 3), ("vocab_size", 10**9),
                   ("vocab_size", 128), ("tie_word_embeddings", False), ("model_type", "bogus"),
                   ("architectures", ["Bogus"]), ("rope_theta", "x"), ("rms_norm_eps", -1.0),
                   ("max_position_embeddings", -5), ("head_dim", 7), ("quantization_config", None),
                   ("quantization_config", []), ("quantization_config", "gptq"), ("auto_map", {"AutoModelForCausalLM": "x.Y"})]
    for key, value in model_edits:
        f = fresh("config-model")
        cfg = json.loads((f / "config.json").read_text())
        cfg[key] = value
        (f / "config.json").write_text(json.dumps(cfg))
        yield f"config-model-{key}={value!r}", f
    for content in (b"", b"{", b"[1, 2]", b"null", b"\xff\xfe garbage", b'{"model_type": 5}', b"{}") if full else ():
        f = fresh("config-garbage")
        (f / "config.json").write_bytes(content)
        yield f"config-garbage-{content[:10]!r}", f
    if full:
        f = fresh("config-missing")
        (f / "config.json").unlink()
        yield "config-missing", f
        # pickles where safetensors were expected: never unpickled
        payload = pickle.dumps({"model.embed_tokens.weight": _Evil(marker)})
        f = fresh("pickle-bin")
        for name in files:
            (f / name).unlink()
        (f / "model.safetensors.index.json").unlink(missing_ok=True)
        (f / "pytorch_model.bin").write_bytes(payload)
        yield "pickle-bin", f
        for how in ("raw", "torch-zip"):
            f = fresh(f"pickle-as-safetensors-{how}")
            for name in files:
                if how == "raw":
                    (f / name).write_bytes(payload)
                else:
                    torch.save({"evil": _Evil(marker)}, f / name)
            yield f"pickle-as-safetensors-{how}", f
    if (base / "model.safetensors.index.json").is_file():
        index_edits = ["garbage", "missing-shard", "outside", "map-list", "absolute"]
        for edit in index_edits:
            f = fresh(f"index-{edit}")
            index_path = f / "model.safetensors.index.json"
            index = json.loads(index_path.read_text())
            key = rng.choice(sorted(index["weight_map"]))
            if edit == "garbage":
                index_path.write_text("{not json")
                yield f"index-{edit}", f
                continue
            if edit == "missing-shard":
                (f / index["weight_map"][key]).unlink()
            elif edit == "outside":
                index["weight_map"][key] = "../" + base.name + "/" + index["weight_map"][key]
            elif edit == "map-list":
                index["weight_map"] = [1, 2]
            elif edit == "absolute":
                index["weight_map"][key] = "/etc/passwd"
            index_path.write_text(json.dumps(index))
            yield f"index-{edit}", f


def _fuzz_child(folder: str, reference: str | None, conn) -> None:
    """Runs in a forked child: load, forward the fixed input, report one JSON line, exit."""
    import quantkit
    from quantkit.errors import QuantkitError

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    try:
        model = quantkit.load(folder)
        with torch.no_grad():
            logits = model(torch.tensor(FIXED_INPUT)).logits.float()
        if reference is None:
            torch.save(logits, Path(folder) / "reference_logits.pt")
            result = {"status": "ok", "finite": True, "equal": True}
        else:
            ref = torch.load(reference, weights_only=True)
            equal = tuple(ref.shape) == tuple(logits.shape) and bool(torch.allclose(ref, logits, rtol=1e-4, atol=1e-4))
            result = {"status": "ok", "finite": bool(torch.isfinite(logits).all()), "equal": equal}
    except QuantkitError as exc:
        result = {"status": "error", "message": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - anything else is what the fuzz test is looking for
        result = {"status": "crash", "message": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-3000:]}
    conn.send(json.dumps(result))
    conn.close()
    os._exit(0)


def _run_forked(jobs: list[tuple[str, str, str | None]]) -> dict[str, dict]:
    """Run each (name, folder, reference) in its own forked child, FUZZ_WORKERS at a time, each
    under FUZZ_TIMEOUT_S; returns name -> result (status ok/error/crash/hang/signal)."""
    ctx = multiprocessing.get_context("fork")
    pending, running, results = list(jobs), {}, {}
    while pending or running:
        while pending and len(running) < FUZZ_WORKERS:
            name, folder, reference = pending.pop(0)
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_fuzz_child, args=(folder, reference, child_conn), daemon=True)
            p.start()
            child_conn.close()
            running[name] = (p, parent_conn, time.monotonic(), folder)
        time.sleep(0.01)
        for name, (p, conn, t0, folder) in list(running.items()):
            message = None
            if conn.poll():
                try:
                    message = json.loads(conn.recv())
                except EOFError:
                    message = None
            if message is not None:
                p.join(FUZZ_TIMEOUT_S)
                if p.is_alive():
                    p.kill()
                    p.join()
                results[name] = {**message, "folder": folder, "seconds": time.monotonic() - t0}
            elif not p.is_alive():
                p.join()
                results[name] = {"status": "signal" if p.exitcode and p.exitcode < 0 else "died", "exitcode": p.exitcode,
                                 "folder": folder}
            elif time.monotonic() - t0 > FUZZ_TIMEOUT_S:
                p.kill()
                p.join()
                results[name] = {"status": "hang", "folder": folder}
            else:
                continue
            conn.close()
            del running[name]
    return results


@pytest.fixture(scope="module")
def fuzz_bases(tmp_path_factory, demo_dir) -> list[Path]:
    """Small quantized checkpoints to corrupt: gptq (one file), compressed-tensors (sharded), awq."""
    work = tmp_path_factory.mktemp("fuzz-bases")
    model = _tiny_model(work / "tiny", demo_dir)
    bases = []
    for name, extra in (("gptq", ["--format", "gptq"]),
                        ("ct", ["--format", "compressed-tensors", "--asym", "--max-shard-size", "40KB"]),
                        ("awq", ["--format", "awq", "--asym"])):
        out = work / name
        proc = run_cli("quantize", "--model", model, "--method", "rtn", "--group-size", "32", "--output", out, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        bases.append(out)
    assert (work / "ct" / "model.safetensors.index.json").is_file()
    return bases


@pytest.mark.slow  # three CLI quantize runs for its bases, then forked loads
def test_fuzzed_checkpoints_fail_cleanly_or_load_correctly(tmp_path, fuzz_bases):
    import transformers

    import quantkit  # noqa: F401  (imported once here; every forked child shares it)
    import quantkit.runtime.loader  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    transformers.utils.logging.set_verbosity_error()  # the plain-model path's loading report
    t_start = time.monotonic()
    marker = tmp_path / "PICKLE_EXECUTED"
    refs = {}
    originals = _run_forked([(b.name, str(b), None) for b in fuzz_bases])
    for b in fuzz_bases:
        assert originals[b.name]["status"] == "ok", originals[b.name]
        refs[b.name] = str(b / "reference_logits.pt")
    jobs = []
    rng = random.Random(20240607)
    for b in fuzz_bases:
        work = tmp_path / f"variants-{b.name}"
        work.mkdir()
        for kind, folder in _variants(b, work, rng, marker, full=b.name == "gptq"):
            jobs.append((f"{folder.name}:{kind}", str(folder), refs[b.name]))
    assert len(jobs) >= 200, len(jobs)
    t_fuzz = time.monotonic()
    results = _run_forked(jobs)
    print(f"\nfuzz: {len(jobs)} variants loaded in {time.monotonic() - t_fuzz:.0f} s")
    assert not marker.exists(), "a pickle was unpickled"

    bad = {n: r for n, r in results.items() if r["status"] not in ("ok", "error")}
    assert not bad, json.dumps(bad, indent=1)[:6000]
    wrong = {n: r for n, r in results.items() if r["status"] == "ok" and not (r["finite"] or r["equal"])}
    assert not wrong, json.dumps(wrong, indent=1)[:6000]
    # errors are one line that names the file or folder at fault
    vague = {n: r["message"] for n, r in results.items() if r["status"] == "error"
             and ("\n" in r["message"] or Path(r["folder"]).name not in r["message"])}
    assert not vague, json.dumps(vague, indent=1)[:6000]
    kinds = {}
    for n, r in results.items():
        kinds.setdefault(n.split(":", 1)[1].split("=")[0], []).append(r["status"])
    summary = {k: f"{v.count('error')} error / {v.count('ok')} ok" for k, v in sorted(kinds.items())}
    print(f"\nfuzz: {len(results)} variants in {time.monotonic() - t_start:.0f} s; " + json.dumps(summary))
    # corruptions that cannot leave a valid checkpoint are all refused; a missing tensor loads only
    # where the format has a default for it (gptq's trivial g_idx, compressed-tensors' weight_shape)
    must_fail = ("truncate", "pickle", "config-garbage", "config-missing", "index-", "header-shape", "header-offset_",
                 "header-length", "header-dtype_bogus", "header-rename", "header-drop", "value-scales-nan",
                 "value-scales-inf", "value-g_idx-range", "value-weight_scale-nan", "value-embed_tokens.weight-nan")
    accepted = {n: r for n, r in results.items() if r["status"] != "error" and (
        n.split(":", 1)[1].startswith(must_fail) or (n.split(":", 1)[1] == "missing-tensor" and not r["equal"]))}
    accepted = {n: r for n, r in accepted.items() if not n.split(":", 1)[1].startswith("header-offset_overlap")
                or r["status"] == "ok" and r["equal"]}  # an entry may be "overlapped" with itself: no change
    assert not accepted, json.dumps(accepted, indent=1)[:6000]


@pytest.mark.slow  # the same three CLI quantize runs (module fixture)
def test_cli_names_the_file_for_a_hostile_checkpoint(tmp_path, fuzz_bases):
    """The CLI face of the fuzz: exit 2 and one line (no traceback) for a pickle posing as safetensors."""
    bad = tmp_path / "bad"
    shutil.copytree(fuzz_bases[0], bad)
    marker = tmp_path / "PICKLE_EXECUTED"
    (bad / "model.safetensors").write_bytes(pickle.dumps(_Evil(marker)))
    assert_clean_error(run_cli("eval", "--model", bad, "--max-windows", "1", "--seq-len", "16"), "model.safetensors")
    assert not marker.exists()


# ------------------------------------------------------------------ numerically hostile calibration

@pytest.fixture(scope="module")
def calib_llama_dir(tmp_path_factory) -> Path:
    """4 small random layers: enough for a poisoned layer with layers after it."""
    return random_llama_with_demo_tokenizer(tmp_path_factory, "calib-llama", layers=4, hidden=64, intermediate=128,
                                            layers_per_shard=4, seed=2)


def _available_methods() -> list[str]:
    from quantkit.quantizers.base import available_methods

    return [m for m in ("rtn", "gptq", "awq", "smoothquant") if m in available_methods()]


def _nan_methods() -> list[str]:
    # awq is left out: it refuses poisoned calibration with a clean QuantkitError ("the scale search
    # ... produced no finite loss") instead of skipping the bad tokens; that is the awq work's to change
    return [m for m in _available_methods() if m != "awq"]


@pytest.mark.parametrize("method", _nan_methods())
def test_nan_inf_and_dead_channels_in_calibration_give_finite_weights(tmp_path, calib_llama_dir, method):
    """A hook poisons what enters decoder layer 1 during calibration: NaN and inf tokens, dead channels."""
    import quantkit
    from quantkit import api, data
    from quantkit.pipeline import quantize_model
    from quantkit.checkpoint import staging_dir, write_checkpoint
    from quantkit.models import get_adapter
    from quantkit.progress import ProgressStore
    from quantkit.quantizers import get_quantizer
    from quantkit.sources import load_source_model

    from quantkit.scheme import scheme_from_dict

    model, tok, _, _ = load_source_model(str(calib_llama_dir))
    quantizer = get_quantizer(method)
    scheme = scheme_from_dict({"bits": 4, "group_size": 32, **getattr(quantizer, "default_scheme", {})})
    scheme = scheme.with_default_sym(quantizer.default_sym)
    schemes = scheme.resolve(api.linear_shapes(model))
    ids = data.calibration_batches("lee", tok, num_samples=8, seq_len=32)

    def poison(module, args, kwargs):
        hidden = (args[0] if args else kwargs["hidden_states"]).clone()
        hidden[:, 3, :] = float("nan")
        hidden[0, 5, 7] = float("inf")
        hidden[1, 6, :] = float("-inf")
        hidden[..., :8] = 0.0  # dead channels
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    handle = get_adapter(model).decoder_layers(model)[1].register_forward_pre_hook(poison, with_kwargs=True)
    store = ProgressStore(staging_dir(tmp_path / "out"))
    store.start({"test": method}, resume=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantize_model(model, get_adapter(model), quantizer, schemes, ids if quantizer.needs_calibration
                       else None, batch_size=4, progress=False, store=store)
    handle.remove()
    results = {k: v for i in store.done_layers() for k, v in store.load_layer(i).quantized.items()}  # what was saved
    assert set(results) == set(schemes)
    for name, qw in results.items():
        assert torch.isfinite(qw.scales).all() and torch.isfinite(qw.dequantize()).all(), name
        assert torch.isfinite(model.get_submodule(name).weight).all(), name
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    if method == "gptq":
        assert any("NaN/inf" in str(w.message) for w in caught), [str(w.message) for w in caught]
    out = write_checkpoint(tmp_path / "out", model, tok, store, "model.layers", quantizer.default_format,
                           quantizer.describe(), quantizer.format_extra(), "small", torch.float32, ["lm_head"])
    loaded = quantkit.load(out, backend="reference", dtype="float32")
    with torch.no_grad():
        assert torch.isfinite(loaded(torch.tensor(FIXED_INPUT)).logits).all()


@pytest.mark.parametrize("method", [m for m in _available_methods() if m != "rtn"])
def test_single_calibration_sample_is_damped_not_nan(tmp_path, calib_llama_dir, method):
    """One calibration sequence of 8 tokens: Hessians far from full rank, damped instead of NaN."""
    import quantkit
    from quantkit import api

    group = {} if method == "smoothquant" else {"group_size": 32}  # W8A8: per-channel weights
    api.quantize(str(calib_llama_dir), method, num_samples=1, seq_len=8, output=tmp_path / "one", progress=False,
                 **group)
    loaded = quantkit.load(tmp_path / "one", backend="reference", dtype="float32")
    for name, p in loaded.state_dict().items():
        if p.is_floating_point():
            assert torch.isfinite(p).all(), name
    with torch.no_grad():
        assert torch.isfinite(loaded(torch.tensor(FIXED_INPUT)).logits).all()
