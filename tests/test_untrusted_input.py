"""A model folder is untrusted input: its file names, symlinks, weights and sizes must not make
quantkit read outside it, destroy the source, round NaNs silently or run past the context window.

Every reader of shard names is tried with a `../` entry, an absolute path and symlinks to a
poisoned copy of a real shard placed outside the folder; each must refuse with a QuantkitError
naming the entry, before anything is loaded (the poisoned copy is a valid checkpoint, so a reader
that opened it would succeed, not fail)."""
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import quantkit
from conftest import run_cli
from quantkit.errors import QuantkitError

pytestmark = pytest.mark.usefixtures("one_thread")

ESCAPES = ("dotdot", "absolute", "symlink")
REFUSED = ("leaves the model folder", "absolute path", "outside the model folder")


def tree_digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sharded_plain(tmp_path_factory, tiny_llama_dir) -> Path:
    """tiny_llama_dir saved in several shards with an index."""
    import transformers

    out = tmp_path_factory.mktemp("plain") / "model"
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.save_pretrained(out, max_shard_size="2MB")
    for f in tiny_llama_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    assert (out / "model.safetensors.index.json").is_file()
    return out


@pytest.fixture(scope="module")
def sharded_quantized(tmp_path_factory, tiny_llama_dir) -> Path:
    """A GPTQ-format RTN checkpoint of the tiny model, in several shards."""
    out = tmp_path_factory.mktemp("quantized") / "model"
    quantkit.quantize(str(tiny_llama_dir), "rtn", group_size=32, output=out, max_shard_size="2MB", progress=False)
    assert (out / "model.safetensors.index.json").is_file()
    return out


def escaped(src: Path, tmp: Path, how: str) -> Path:
    """A copy of `src` whose index names one shard outside it, `how`: `../`, an absolute path, or a
    symlink in the folder pointing to the copy outside."""
    folder, outside = tmp / f"model-{how}", tmp / "outside"
    shutil.copytree(src, folder)
    outside.mkdir(exist_ok=True)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    shutil.move(folder / shard, outside / shard)  # the only copy of that shard is now outside
    if how == "symlink":
        (folder / shard).symlink_to(outside / shard)
        return folder
    target = f"../outside/{shard}" if how == "dotdot" else str(outside / shard)
    index["weight_map"] = {k: (target if v == shard else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    return folder


def assert_refused(call, *needles):
    with pytest.raises(QuantkitError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    assert any(r in message for r in REFUSED), message
    for n in needles:
        assert n in message, message
    return message


# -- every reader of a source (full-precision) folder --------------------------------------------

@pytest.mark.parametrize("how", ESCAPES)
def test_quantize_readers_refuse_escapes(tmp_path, sharded_plain, how, monkeypatch):
    from quantkit import streaming
    from quantkit.sources import load_source_model

    folder = escaped(sharded_plain, tmp_path, how)
    out = tmp_path / "out"
    for mode in (False, True, None):  # the default loader, --streaming, and the automatic choice
        assert_refused(lambda: quantkit.quantize(str(folder), "rtn", output=out, streaming=mode, progress=False))
    assert_refused(lambda: load_source_model(str(folder), streaming=True))
    assert_refused(lambda: streaming.weight_files(folder))
    # the automatic streaming decision reads the index to size the weights: it refuses too, even when
    # memory is so small that streaming would switch on by itself
    monkeypatch.setattr(streaming, "available_memory_bytes", lambda: 1)
    assert_refused(lambda: streaming.should_stream(folder, torch.float32))
    assert_refused(lambda: quantkit.quantize(str(folder), "rtn", output=out, progress=False, resume=True))
    assert not out.exists()


@pytest.mark.parametrize("how", ESCAPES)
def test_checkpoint_readers_refuse_escapes(tmp_path, sharded_quantized, sharded_plain, how):
    from quantkit.convert import convert
    from quantkit.engine.api import load_model_and_tokenizer
    from quantkit.inspect import inspect_checkpoint

    for src in (sharded_quantized, sharded_plain):
        folder = escaped(src, tmp_path / src.parent.name, how)
        assert_refused(lambda: quantkit.load(str(folder)))  # the runtime loader, quantized or plain
        assert_refused(lambda: load_model_and_tokenizer(str(folder)))  # the engine's (generate, bench)
        assert_refused(lambda: inspect_checkpoint(str(folder)))
    folder = tmp_path / sharded_quantized.parent.name / f"model-{how}"
    assert_refused(lambda: convert(folder, "compressed-tensors", tmp_path / "conv"))
    assert_refused(lambda: convert(folder, "gguf", tmp_path / "conv-gguf", gguf_type="Q4_0"))
    assert not (tmp_path / "conv").exists() and not (tmp_path / "conv-gguf").exists()


def test_unsharded_symlinks_refused(tmp_path, tiny_llama_dir):
    """model.safetensors itself, or a tokenizer/config file, linked to a file outside the folder."""
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        folder = tmp_path / f"m-{name}"
        shutil.copytree(tiny_llama_dir, folder)
        shutil.move(folder / name, outside / name)
        (folder / name).symlink_to(outside / name)
        assert_refused(lambda: quantkit.quantize(str(folder), "rtn", output=tmp_path / "o", progress=False), name)
        assert_refused(lambda: quantkit.quantize(str(folder), "rtn", output=tmp_path / "o", streaming=True,
                                                 progress=False), name)
        assert_refused(lambda: quantkit.load(str(folder)), name)
        (outside / name).unlink()


def test_index_names_refused_lexically(tmp_path, sharded_plain):
    """`..` inside a name is refused even where it would land back inside; so are Windows absolute
    paths and non-strings."""
    from quantkit.model_files import model_file

    for bad in ("sub/../../x.safetensors", "./../x", "C:\\x.safetensors", "\\\\server\\share\\x", "/x"):
        with pytest.raises(QuantkitError, match="leaves the model folder|absolute path"):
            model_file(sharded_plain, bad, "weight_map")
    for bad in ("", None, 5, "a\x00b"):
        with pytest.raises(QuantkitError, match="not a file name"):
            model_file(sharded_plain, bad, "weight_map")
    assert model_file(sharded_plain, "config.json") == sharded_plain / "config.json"


def test_link_inside_the_folder_is_fine(tmp_path, tiny_llama_dir):
    """A symlink whose target is inside the folder (e.g. a shard kept in a subfolder) loads."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "store").mkdir()
    shutil.move(folder / "model.safetensors", folder / "store" / "weights.safetensors")
    (folder / "model.safetensors").symlink_to(Path("store") / "weights.safetensors")
    reference = quantkit.load(str(tiny_llama_dir))
    model = quantkit.load(str(folder))
    ids = torch.tensor([[1, 5, 9, 300]])
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


def fake_hub_cache(root: Path, src: Path, repo: str = "models--org--tiny") -> Path:
    """`src` laid out as huggingface_hub's cache does: blobs named by hash, the snapshot's files
    symlinks to ../../blobs/<hash>."""
    repo_dir = root / repo
    snapshot = repo_dir / "snapshots" / "0123abcd"
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text("0123abcd")
    for f in sorted(src.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo_dir / "blobs" / digest)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snapshot


def test_hub_cache_layout_loads_and_other_repos_are_refused(tmp_path, sharded_plain, sharded_quantized):
    from quantkit.sources import load_source_model

    snapshot = fake_hub_cache(tmp_path / "hub", sharded_plain)
    assert all((snapshot / f).is_symlink() for f in os.listdir(snapshot))
    model, _, _, _ = load_source_model(str(snapshot), streaming=True)
    assert model is not None
    ids = torch.tensor([[1, 5, 9, 300]])
    torch.testing.assert_close(quantkit.load(str(snapshot))(ids).logits, quantkit.load(str(sharded_plain))(ids).logits,
                               rtol=0, atol=0)
    qsnap = fake_hub_cache(tmp_path / "hub", sharded_quantized, "models--org--tiny-q")
    assert quantkit.load(str(qsnap)) is not None
    # a snapshot file linked to another repository's blob leaves its repository: refused
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    other_blob = sorted((qsnap.parent.parent / "blobs").iterdir())[0]  # any blob of the other repository
    (snapshot / shard).unlink()
    (snapshot / shard).symlink_to(Path("..") / ".." / ".." / "models--org--tiny-q" / "blobs" / other_blob.name)
    assert_refused(lambda: quantkit.load(str(snapshot)), shard)
    assert_refused(lambda: load_source_model(str(snapshot), streaming=True), shard)


def test_gguf_file_named_by_config_stays_inside(tmp_path):
    """A folder's config.json names its GGUF file (quantization_config.gguf_file): `../`, absolute
    and symlinked names are refused by the runtime loader."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.gguf").write_bytes(b"GGUF")
    for how, name in (("dotdot", "../outside/model.gguf"), ("absolute", str(outside / "model.gguf")),
                      ("symlink", "model.gguf")):
        folder = tmp_path / how
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
            "quant_method": "gguf", "gguf_file": name}}))
        if how == "symlink":
            (folder / "model.gguf").symlink_to(outside / "model.gguf")
        assert_refused(lambda: quantkit.load(str(folder)))


@pytest.mark.slow  # command-line runs in subprocesses (~15-40 s)
def test_cli_streaming_traversal_exits_2(tmp_path, sharded_plain):
    folder = escaped(sharded_plain, tmp_path, "dotdot")
    proc = run_cli("quantize", "--model", folder, "--method", "rtn", "--streaming", "--output", tmp_path / "o")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "leaves the model folder" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()


# -- the source model is never destroyed ---------------------------------------------------------

def test_quantize_never_overwrites_its_source(tmp_path, tiny_llama_dir):
    src = tmp_path / "src"
    shutil.copytree(tiny_llama_dir, src)
    (src / "sub").mkdir()
    (src / "sub" / "notes.txt").write_text("mine")
    before = tree_digest(src)
    for output, why in ((src, "is the source model"), (tmp_path, "contains the source model"),
                        (src / "sub", "inside the source model")):
        with pytest.raises(QuantkitError, match=why):
            quantkit.quantize(str(src), "rtn", output=output, overwrite=True, progress=False)
        assert tree_digest(src) == before
    # a new folder inside the source touches none of its files
    quantkit.quantize(str(src), "rtn", group_size=32, output=src / "quantized", progress=False)
    assert (src / "quantized" / "config.json").is_file()
    assert {k: v for k, v in tree_digest(src).items() if not k.startswith("quantized")} == before


@pytest.mark.slow  # a command-line run in a subprocess
def test_cli_refuses_the_source_as_output(tmp_path, tiny_llama_dir):
    src = tmp_path / "src"
    shutil.copytree(tiny_llama_dir, src)
    before = tree_digest(src)
    proc = run_cli("quantize", "--model", src, "--method", "rtn", "--output", src, "--overwrite")
    assert proc.returncode == 2 and "is the source model" in proc.stderr, proc.stderr[-2000:]
    assert tree_digest(src) == before


def test_convert_never_overwrites_its_source(tmp_path, sharded_quantized):
    from quantkit.convert import convert

    src = tmp_path / "q"
    shutil.copytree(sharded_quantized, src)
    before = tree_digest(src)
    for output in (src, tmp_path):
        with pytest.raises(QuantkitError, match="source model"):
            convert(src, "compressed-tensors", output, overwrite=True)
    assert tree_digest(src) == before


# -- NaN/inf weights are refused, naming the tensor ---------------------------------------------

def poisoned_copy(src: Path, tmp: Path, tensor: str, value=float("nan")) -> Path:
    folder = tmp / f"poisoned-{tensor}"
    shutil.copytree(src, folder)
    state = load_file(folder / "model.safetensors")
    state[tensor] = state[tensor].clone()
    state[tensor].view(-1)[37] = value
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("options", [{}, {"mse": False}])
def test_rtn_refuses_nan_weight(tmp_path, tiny_llama_dir, options, streaming):
    linear, norm, final = "model.layers.1.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight"
    for name, value in ((linear, float("nan")), (linear, float("inf")), (linear, float("-inf")), (norm, float("nan")),
                        (final, float("inf"))):
        folder = poisoned_copy(tiny_llama_dir, tmp_path / str(value), name, value)
        out = tmp_path / str(value) / f"o-{name}"
        with pytest.raises(QuantkitError, match=f"tensor {name} holds 1 NaN/inf"):
            quantkit.quantize(str(folder), "rtn", group_size=32, output=out, options=options, streaming=streaming,
                              progress=False)
        assert not out.exists()


def test_driver_refuses_nan_weight_it_is_handed(tiny_llama_dir):
    """The calibration driver's own check (for weights no loader checked, e.g. an in-memory model)."""
    import transformers

    from types import SimpleNamespace

    from quantkit.pipeline.staged import quantize_in_place
    from quantkit.quantizers.recipe import build_recipe
    from quantkit.scheme import LinearScheme

    layer = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).model.layers[0]
    layer.mlp.up_proj.weight.data[1, 2] = float("nan")
    ctx = SimpleNamespace(prefix="model.layers.0.", experts=None, schemes={"mlp.up_proj": LinearScheme(4, 32, True)})
    with pytest.raises(QuantkitError, match="tensor model.layers.0.mlp.up_proj.weight holds 1 NaN/inf"):
        quantize_in_place(ctx, build_recipe("rtn", {}), "mlp.up_proj", layer.mlp.up_proj)


def test_gguf_grids_refuse_nan_weight(tmp_path, tiny_llama_dir):
    name = "model.layers.0.self_attn.q_proj.weight"
    folder = poisoned_copy(tiny_llama_dir, tmp_path, name)
    with pytest.raises(QuantkitError, match=f"tensor {name} holds 1 NaN/inf"):
        quantkit.quantize(str(folder), "rtn", format="gguf", gguf_type="Q4_0", output=tmp_path / "o", progress=False)
    # a tensor GGUF rounds itself (the token embedding, no linear of the calibration driver)
    from quantkit.formats.gguf.export import to_planned
    from quantkit.formats.gguf.plan import PlannedTensor
    from quantkit.formats.gguf.types import TYPES

    bad = torch.randn(4, 64)
    bad[2, 3] = float("nan")
    planned = PlannedTensor(hf_name="model.embed_tokens.weight", gguf_name="token_embd.weight", shape=(4, 64),
                            type=TYPES["Q4_0"])
    with pytest.raises(QuantkitError, match="tensor model.embed_tokens.weight holds 1 NaN/inf"):
        to_planned(planned, bad)


def test_convert_refuses_nan_tensors(tmp_path, sharded_quantized):
    from quantkit.convert import convert

    index = json.loads((sharded_quantized / "model.safetensors.index.json").read_text())["weight_map"]
    for name in ("model.layers.0.self_attn.q_proj.scales", "model.norm.weight"):
        folder = tmp_path / name
        shutil.copytree(sharded_quantized, folder)
        shard = folder / index[name]
        state = load_file(shard)
        state[name] = state[name].clone()
        state[name].view(-1)[0] = float("nan")
        save_file(state, shard, metadata={"format": "pt"})
        for target, kw in (("compressed-tensors", {}), ("gguf", {"gguf_type": "Q4_0"})):
            with pytest.raises(QuantkitError, match=f"tensor {name} holds 1 NaN/inf"):
                convert(folder, target, tmp_path / "out", **kw)
        assert not (tmp_path / "out").exists()


# -- nothing runs past the context window --------------------------------------------------------

def test_engine_refuses_requests_past_the_context():
    from tiny_models import greedy, tiny_model

    from quantkit.engine import LLMEngine

    engine = LLMEngine(tiny_model("llama", max_position_embeddings=32), kv_cache_memory=2**20)
    assert engine.max_model_len == 32
    with pytest.raises(QuantkitError, match=r"= 33 exceeds the model's context of 32 tokens.*--max-new-tokens"):
        engine.generate([list(range(3, 28))], greedy(8))
    with pytest.raises(QuantkitError, match="exceeds the model's context of 32"):
        engine.generate([list(range(3, 43))], greedy(1))  # the prompt alone is too long
    out = engine.generate([list(range(3, 27))], greedy(8))[0]  # exactly 32: fine
    assert len(out["token_ids"]) == 8


def short_context_copy(tmp_path: Path, src: Path, context: int) -> Path:
    """A copy of `src` whose config allows only `context` positions."""
    folder = tmp_path / "short"
    shutil.copytree(src, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["max_position_embeddings"] = context
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.slow  # command-line runs in subprocesses (~15-40 s)
def test_generate_cli_refuses_past_the_context(tmp_path, tiny_llama_dir):
    folder = short_context_copy(tmp_path, tiny_llama_dir, 16)
    proc = run_cli("generate", "--model", folder, "--prompt", "one two three four five six seven eight nine ten",
                   "--max-new-tokens", "16")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "context of 16 tokens" in lines[0] and "--max-new-tokens" in lines[0], proc.stderr


def test_eval_refuses_seq_len_past_the_context(tmp_path, tiny_llama_dir):
    from quantkit.api import evaluate

    folder = short_context_copy(tmp_path, tiny_llama_dir, 64)
    with pytest.raises(QuantkitError, match=r"--seq-len 128 exceeds the context of .* \(64 tokens.*--seq-len 64"):
        evaluate(str(folder), seq_len=128, max_windows=1)
    with pytest.raises(QuantkitError, match="64 tokens"):  # the baseline's context counts too
        evaluate(str(tiny_llama_dir), baseline=str(folder), seq_len=128, max_windows=1)
    assert evaluate(str(folder), seq_len=64, max_windows=1)["windows"] == 1


def test_quantize_eval_scores_within_the_context(tmp_path, tiny_llama_dir):
    from quantkit.api import _eval_seq_len

    folder = short_context_copy(tmp_path, tiny_llama_dir, 64)
    with pytest.warns(UserWarning, match="windows of 64 tokens"):
        assert _eval_seq_len(folder) == 64
    assert _eval_seq_len(tiny_llama_dir) == 512


# -- repository code ---------------------------------------------------------------------------

def custom_code_folder(tmp_path: Path, src: Path) -> tuple[Path, dict]:
    """A copy of `src` whose config asks for repository code that, if ever run, exits the process."""
    folder = tmp_path / "custom"
    shutil.copytree(src, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="my_custom_arch", auto_map={"AutoConfig": "configuration_x.XConfig",
                                                      "AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "modeling_x.py").write_text("raise SystemExit('repository code ran')\n")
    (folder / "configuration_x.py").write_text("raise SystemExit('repository code ran')\n")
    return folder, cfg


def test_remote_code_names_the_flag(tmp_path, tiny_llama_dir):
    from quantkit.convert import convert

    folder, cfg = custom_code_folder(tmp_path, tiny_llama_dir)
    with pytest.raises(QuantkitError, match="--trust-remote-code"):
        quantkit.quantize(str(folder), "rtn", output=tmp_path / "o", progress=False)
    with pytest.raises(QuantkitError, match="trust_remote_code=True"):
        quantkit.load(str(folder))
    with pytest.raises(QuantkitError, match="never runs a repository's code"):
        convert(folder, "gguf", tmp_path / "c", gguf_type="F16")
    # auto_map beside a model_type transformers knows: its own code builds the model, nothing is asked
    cfg["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(cfg))
    assert quantkit.load(str(folder)) is not None


class _Marker:
    """Unpickling this creates a file: proof that a pickle was loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_pickle_weights_are_never_loaded(tmp_path, tiny_llama_dir):
    import pickle

    folder = tmp_path / "pickled"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": _Marker(marker)}))
    for call in (lambda: quantkit.quantize(str(folder), "rtn", output=tmp_path / "o", progress=False),
                 lambda: quantkit.quantize(str(folder), "rtn", output=tmp_path / "o", streaming=True, progress=False),
                 lambda: quantkit.load(str(folder))):
        with pytest.raises(QuantkitError, match="pickle weights"):
            call()
    assert not marker.exists()


@pytest.mark.slow  # command-line runs in subprocesses (~15-40 s)
def test_hub_id_snapshot_is_checked(tmp_path, sharded_plain):
    """A hub id resolved offline from the cache: its snapshot gets the folder checks (a shard linked
    to another repository's blob is refused), and a clean snapshot quantizes."""
    hub = tmp_path / "hub"
    snapshot = fake_hub_cache(hub, sharded_plain)
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = run_cli("quantize", "--model", "org/tiny", "--method", "rtn", "--group-size", "32",
                   "--output", tmp_path / "good", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    outside = tmp_path / "elsewhere.safetensors"
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    shutil.copy(snapshot / shard, outside)
    (snapshot / shard).unlink()
    (snapshot / shard).symlink_to(outside)
    proc = run_cli("quantize", "--model", "org/tiny", "--method", "rtn", "--output", tmp_path / "bad", env=env)
    assert proc.returncode == 2 and "outside the model folder" in proc.stderr and shard in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow  # a command-line run in a subprocess
def test_cli_remote_code_names_the_flag(tmp_path, tiny_llama_dir):
    folder, _ = custom_code_folder(tmp_path, tiny_llama_dir)
    proc = run_cli("quantize", "--model", folder, "--method", "rtn", "--output", tmp_path / "o")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "--trust-remote-code" in lines[0], proc.stderr[-2000:]
    assert "repository code ran" not in proc.stderr


def test_quantize_refuses_calibration_past_the_context(tmp_path, tiny_llama_dir):
    import quantkit

    folder = short_context_copy(tmp_path, tiny_llama_dir, 64)
    with pytest.raises(QuantkitError, match=r"sequences of 128 tokens exceed the model's context \(64 tokens.*--seq-len 64"):
        quantkit.quantize(str(folder), "gptq", bits=4, group_size=32, num_samples=4, seq_len=128,
                          output=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    rows = torch.randint(0, 100, (2, 96))  # in-memory rows are refused the same way
    with pytest.raises(QuantkitError, match=r"96 tokens exceed the model's context \(64"):
        quantkit.quantize(str(folder), "gptq", bits=4, group_size=32, dataset=rows, output=tmp_path / "out",
                          progress=False)
    quantkit.quantize(str(folder), "gptq", bits=4, group_size=32, num_samples=4, seq_len=64,
                      output=tmp_path / "ok", progress=False)
    assert (tmp_path / "ok" / "config.json").is_file()


def test_max_memory_without_a_device_map_is_refused(tmp_path, tiny_llama_dir):
    import quantkit

    with pytest.raises(QuantkitError, match="--max-memory budgets --device-map.*--device-map auto"):
        quantkit.quantize(str(tiny_llama_dir), "rtn", bits=4, group_size=32, max_memory="cpu=1GiB",
                          output=tmp_path / "out", progress=False)
