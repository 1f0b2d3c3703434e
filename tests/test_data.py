"""quantkit.data: sources, splits, deterministic calibration windows, eval streams, errors.

Fast tests use a word-level tokenizer built in memory (token "wN" -> id N+3), so token counts
are exact and nothing is downloaded. Slow tests use the real demo tokenizer and Lee corpus.
"""
import json

import pytest
import torch

from quantkit import data
from quantkit.errors import QuantkitError

BOS, EOS = 1, 2


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<bos>": BOS, "<eos>": EOS, **{f"w{i}": i + 3 for i in range(1000)}}
    for word in ("user", "assistant", "system", ":"):
        vocab[word] = len(vocab)
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", bos_token="<bos>", eos_token="<eos>")


@pytest.fixture
def chat_tok(tok):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = "{% for m in messages %}<bos> {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
    return t


def doc(i, n=10):
    """Document i: n distinct words, so every window can be traced back to its document."""
    return " ".join(f"w{(i * n + k) % 1000}" for k in range(n))


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


# --------------------------------------------------------------------------- sources


@pytest.mark.parametrize("suffix", [".txt", ".cor"])
def test_text_file_lines_are_documents(tmp_path, suffix):
    f = write_lines(tmp_path / f"c{suffix}", [doc(0), "", "   ", doc(1), doc(2), doc(3), doc(4)])
    assert data.load_texts(f, "all") == [doc(i) for i in range(5)]
    # 7 lines -> first 80 % (6 lines, one is blank) calibrate, the last line is held out
    assert data.load_texts(f, "calibration") == [doc(i) for i in range(4)]
    assert data.load_texts(str(f), "eval") == [doc(4)]


def test_jsonl_json_parquet_text_field(tmp_path):
    import pandas as pd

    rows = [{"text": doc(i), "id": i} for i in range(5)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "a.json").write_text(json.dumps(rows))
    pd.DataFrame(rows).to_parquet(tmp_path / "a.parquet")
    for name in ("a.jsonl", "a.json", "a.parquet"):
        assert data.load_texts(tmp_path / name, "all") == [doc(i) for i in range(5)], name
        assert data.load_texts(tmp_path / name, "calibration") == [doc(i) for i in range(4)], name


def test_messages_rendered_with_chat_template_or_fallback(tmp_path, tok, chat_tok):
    conv = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"messages": conv}) + "\n")
    assert data.load_texts(f, "all", chat_tok) == ["<bos> user w1 w2 <eos> <bos> assistant w3 <eos> "]
    assert data.load_texts(f, "all", tok) == ["user: w1 w2\nassistant: w3"]  # no template: role lines
    # chat_template=True wraps plain text as one user turn
    assert data.load_texts(["w5"], tokenizer=chat_tok, chat_template=True) == ["<bos> user w5 <eos> "]
    with pytest.raises(QuantkitError, match="no chat template"):
        data.load_texts(["w5"], tokenizer=tok, chat_template=True)


def test_in_memory_sources(tok):
    import datasets

    texts = [doc(i) for i in range(4)]
    assert data.load_texts(texts) == texts  # used as given: no 80/20 split
    assert data.load_texts(datasets.Dataset.from_dict({"text": texts})) == texts
    conv = [[{"role": "user", "content": "w1"}]]
    assert data.load_texts(datasets.Dataset.from_dict({"messages": conv})) == ["user: w1"]
    with pytest.raises(QuantkitError, match="no 'text' or 'messages' field"):
        data.load_texts(datasets.Dataset.from_dict({"body": texts}))


def test_token_tensor_sources():
    stream = torch.arange(100)
    windows = data.calibration_batches(stream.view(10, 10), None, num_samples=10, seq_len=10)
    assert torch.equal(windows, stream.view(10, 10))  # all chunks requested: returned in order
    two = data.calibration_batches([stream[:55], stream[55:]], None, num_samples=3, seq_len=20, seed=1)
    assert two.shape == (3, 20)
    assert all(int(r[0]) % 20 == 0 and torch.equal(r, torch.arange(int(r[0]), int(r[0]) + 20)) for r in two)
    assert len({int(r[0]) for r in two}) == 3
    assert torch.equal(data.eval_token_stream(stream.view(4, 25), None), stream)
    assert torch.equal(data.eval_token_stream(stream, None, max_tokens=7), stream[:7])
    with pytest.raises(QuantkitError, match="integer ids"):
        data.calibration_batches(torch.zeros(4, 4), None, num_samples=1, seq_len=4)
    with pytest.raises(QuantkitError, match="token ids have no text"):
        data.load_texts(stream)


# --------------------------------------------------------------------------- calibration windows


def test_calibration_deterministic_and_seeded(tok):
    texts = [doc(i) for i in range(50)]  # 50 docs x (10 + EOS) = 550 tokens
    a = data.calibration_batches(texts, tok, num_samples=8, seq_len=16, seed=0)
    b = data.calibration_batches(texts, tok, num_samples=8, seq_len=16, seed=0)
    c = data.calibration_batches(texts, tok, num_samples=8, seq_len=16, seed=1)
    assert a.dtype == torch.long and a.shape == (8, 16)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # windows come from one stream of whole documents each followed by EOS, never overlapping
    flat = a.reshape(-1).tolist()
    words = [t for t in flat if t != EOS]
    assert len(words) == len(set(words))
    assert BOS not in flat


def test_calibration_too_many_tokens_says_how_many(tok):
    texts = [doc(i) for i in range(10)]  # 10 x 11 = 110 tokens
    with pytest.raises(QuantkitError) as err:
        data.calibration_batches(texts, tok, num_samples=4, seq_len=32)
    msg = str(err.value)
    assert "needs 128 tokens" in msg and "only 110" in msg and "--num-samples" in msg
    assert data.calibration_batches(texts, tok, num_samples=5, seq_len=22).shape == (5, 22)  # exactly 110
    with pytest.raises(QuantkitError, match="only 100"):
        data.calibration_batches(torch.arange(100), None, num_samples=2, seq_len=51)


def test_empty_sources(tmp_path, tok):
    (tmp_path / "empty.txt").write_text("")
    write_lines(tmp_path / "blank.txt", ["", "  ", ""])
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": doc(0)}) + "\n")
    for src, split in [(tmp_path / "empty.txt", "calibration"), (tmp_path / "blank.txt", "all"),
                       (tmp_path / "one.jsonl", "eval"), ([], "calibration"), (["", " "], "calibration")]:
        with pytest.raises(QuantkitError, match="is empty"):
            data.load_texts(src, split)
    with pytest.raises(QuantkitError, match="is empty"):
        data.calibration_batches(tmp_path / "blank.txt", tok, num_samples=1, seq_len=1, split="all")
    with pytest.raises(QuantkitError, match="are empty"):
        data.eval_token_stream(torch.empty(0, dtype=torch.long), None)


def test_bad_sources(tmp_path):
    with pytest.raises(QuantkitError, match="not found"):
        data.load_texts(tmp_path / "missing.jsonl")
    with pytest.raises(QuantkitError, match="unknown dataset 'nope'.*lee"):
        data.load_texts("nope")
    (tmp_path / "x.csv").write_text("text\nw1\n")
    with pytest.raises(QuantkitError, match="unsupported dataset file type"):
        data.load_texts(tmp_path / "x.csv")
    with pytest.raises(QuantkitError, match="unknown split"):
        data.load_texts(write_lines(tmp_path / "ok.txt", ["w1"]), "train")


# --------------------------------------------------------------------------- eval stream


def test_eval_stream_joins_and_starts_with_bos(tok):
    texts = ["w1 w2", "w3"]
    ids = data.eval_token_stream(texts, tok).tolist()
    assert ids == [BOS, 4, 5, 6]  # "\n\n" is whitespace for this tokenizer
    assert data.eval_token_stream([doc(i) for i in range(500)], tok, max_tokens=33).tolist() == \
        data.eval_token_stream([doc(i) for i in range(500)], tok)[:33].tolist()


# --------------------------------------------------------------------------- registry / lee


def test_registry_names_resolve():
    reg = data.registry()
    assert set(reg) >= {"lee", "wiki", "wikitext2", "c4", "pileval", "ultrachat"}
    for name in reg:
        spec = data.dataset_spec(name)
        assert spec.name == name and spec.field in ("text", "messages")
        assert spec.calibration.split and spec.eval.split
        assert spec.offline == (name in ("lee", "wiki"))
        assert spec.offline or spec.path
    assert reg["ultrachat"].field == "messages"
    assert reg["c4"].eval.data_files.startswith("en/c4-validation")


def test_lee_split_is_disjoint(tmp_path, monkeypatch):
    corpus = write_lines(tmp_path / "lee_background.cor", [doc(i) for i in range(10)])
    monkeypatch.setenv("QUANTKIT_LEE_CORPUS", str(corpus))
    cal, ev = data.load_texts("lee", "calibration"), data.load_texts("lee", "eval")
    assert cal == [doc(i) for i in range(9)] and ev == [doc(9)]  # 90 / 10 by documents
    assert data.load_texts("lee", "all") == cal + ev


def test_held_out_drops_documents_repeated_from_calibration(tmp_path, monkeypatch):
    docs = [doc(i) for i in range(9)] + [doc(3)]  # the last (held-out) document repeats a calibration one
    monkeypatch.setenv("QUANTKIT_LEE_CORPUS", str(write_lines(tmp_path / "lee_background.cor", docs)))
    with pytest.raises(QuantkitError, match=r"eval split\) is empty"):  # nothing held out is left
        data.load_texts("lee", "eval")
    local = write_lines(tmp_path / "mine.txt", [doc(i) for i in range(8)] + [doc(1), doc(42)])
    assert data.load_texts(str(local), "eval") == [doc(42)]  # 80/20: doc(1) and doc(42) held out, doc(1) seen


def test_hub_failure_is_a_clear_error(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(QuantkitError) as err:
        data.load_texts("wikitext2", "eval")
    msg = str(err.value)
    assert "needs the Hugging Face Hub" in msg and "--dataset lee" in msg and "\n" not in msg


def test_hub_arguments(monkeypatch):
    import datasets

    calls = []

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_dict({"text": ["w1"], "messages": [[{"role": "user", "content": "w2"}]]})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    data.load_texts("wikitext2", "eval")
    data.load_texts("c4", "calibration")
    assert data.load_texts("ultrachat", "eval") == ["user: w2"]
    assert calls[0] == (("wikitext", "wikitext-2-raw-v1"), {"split": "test"})
    assert calls[1] == (("allenai/c4",), {"split": "train",
                                         "data_files": {"train": "en/c4-train.00000-of-01024.json.gz"}})
    assert calls[2] == (("HuggingFaceH4/ultrachat_200k",), {"split": "test_sft"})


@pytest.mark.slow
def test_lee_with_demo_tokenizer(monkeypatch):
    """Real corpus and SmolLM2 tokenizer: the default 128 x 512 request and the split sizes."""
    from transformers import AutoTokenizer

    from quantkit import assets

    monkeypatch.delenv("QUANTKIT_CACHE")  # the real cache: the download and conversion happen once
    tok = AutoTokenizer.from_pretrained(assets.demo_model_dir())
    cal, ev = data.load_texts("lee", "calibration"), data.load_texts("lee", "eval")
    # 90/10 by documents; the corpus repeats 7 documents and one repeat straddles the split: dropped from eval
    assert (len(cal), len(ev)) == (270, 29) and not set(cal) & set(ev)
    batches = data.calibration_batches("lee", tok, num_samples=64, seq_len=512)
    assert batches.shape == (64, 512)
    assert torch.equal(batches, data.calibration_batches("lee", tok, num_samples=64, seq_len=512))
    stream = data.eval_token_stream("lee", tok)
    assert stream[0] == tok.bos_token_id and (stream == tok.bos_token_id).sum() == 1
    n_cal = sum(len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in cal)
    print(f"\nlee tokens (SmolLM2): calibration stream {n_cal}, eval stream {len(stream)}")
