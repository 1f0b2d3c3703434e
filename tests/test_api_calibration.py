"""quantkit.quantize from Python: in-memory models and every calibration container.

The oracle for the containers is the token rows themselves, built independently of the code under
test (a plain tensor), and transformers' own apply_chat_template for conversations. The oracle for
"same rows, same checkpoint" is the bytes of the safetensors file written from a folder and a list."""
from __future__ import annotations

import hashlib
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

import quantkit
from quantkit.calibration_sources import calibration_tokens, tokens_sha256
from quantkit.errors import QuantkitError

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = torch.randint(3, 49152, (6, 32), generator=torch.Generator().manual_seed(1))  # 6 rows of 32 token ids
GPTQ = dict(method="gptq", group_size=32, progress=False)


def file_sha(folder: Path) -> str:
    return hashlib.sha256((Path(folder) / "model.safetensors").read_bytes()).hexdigest()


def card_line(folder: Path, key: str) -> str:
    lines = [ln for ln in (Path(folder) / "README.md").read_text().splitlines() if ln.startswith(f"- {key}: ")]
    assert len(lines) == 1, lines
    return lines[0].split(": ", 1)[1].strip("`")


# --------------------------------------------------------------------------- containers -> token rows


def _token_containers():
    """Every token container form of the same six rows (the issue's list), by name."""
    rows = ROWS
    mask = torch.ones_like(rows)
    return {
        "tensor [B, T]": rows,
        "list of 1-D tensors": list(rows),
        "tuple of 1-D tensors": tuple(rows),
        "list of lists of ints": rows.tolist(),
        "numpy array": rows.numpy(),
        "dict with input_ids": {"input_ids": rows},
        "BatchEncoding with attention_mask": transformers.BatchEncoding({"input_ids": rows, "attention_mask": mask}),
        "list of {input_ids} dicts (unbatched)": [{"input_ids": r} for r in rows],
        "list of {input_ids} dicts (batched)": [{"input_ids": rows[:4]}, {"input_ids": rows[4:]}],
        "Dataset input_ids column": datasets.Dataset.from_dict({"input_ids": rows.tolist()}),
        "Dataset input_ids (torch format)": datasets.Dataset.from_dict(
            {"input_ids": rows.tolist(), "attention_mask": mask.tolist()}).with_format("torch"),
        "DataLoader of {input_ids} batches": DataLoader([{"input_ids": r} for r in rows], batch_size=4),
        "DataLoader of tensors": DataLoader(list(rows), batch_size=5),
        "DataLoader over TensorDataset": DataLoader(TensorDataset(rows), batch_size=4),
        "DataLoader unbatched": DataLoader(list(rows), batch_size=None),
        "generator of rows": (r for r in rows),
        "generator of [1, T] batches": (r[None] for r in rows),
    }


@pytest.mark.parametrize("name", list(_token_containers()))
def test_every_token_container_gives_the_same_rows(name):
    tokens = calibration_tokens(_token_containers()[name], None)
    assert tokens.input_ids.dtype == torch.int64
    assert torch.equal(tokens.input_ids, ROWS), name  # uniform rows, no shape asked: used as given, in order
    assert tokens.sha256 == hashlib.sha256(ROWS.numpy().astype("<i8").tobytes()).hexdigest()
    assert "6 token rows as given [6 x 32]" in tokens.source


def test_padding_is_removed_and_ragged_rows_are_packed():
    """A padded batch (right or left padding) calibrates on its real tokens only: the rows, joined end
    to end, cut into windows as long as the longest row; the tail shorter than a window dropped."""
    lengths = [32, 20, 27, 32, 9]
    real = [torch.arange(100 * i, 100 * i + n) for i, n in enumerate(lengths)]
    padded, mask = torch.zeros(5, 32, dtype=torch.long), torch.zeros(5, 32, dtype=torch.long)
    for i, r in enumerate(real):
        cols = slice(0, len(r)) if i % 2 else slice(32 - len(r), 32)  # right and left padding mixed
        padded[i, cols], mask[i, cols] = r, 1
    stream = torch.cat(real)
    expected = stream[: (len(stream) // 32) * 32].view(-1, 32)
    for source in ({"input_ids": padded, "attention_mask": mask},
                   DataLoader(TensorDataset(padded, mask), batch_size=2,
                              collate_fn=lambda b: {"input_ids": torch.stack([x for x, _ in b]),
                                                    "attention_mask": torch.stack([m for _, m in b])}),
                   real):
        tokens = calibration_tokens(source, None)
        assert torch.equal(tokens.input_ids, expected)
        assert "5 token rows (9..32 tokens) packed into 3 windows of 32" in tokens.source
    windows = calibration_tokens(real, None, seq_len=16).input_ids  # a window length asked for
    assert torch.equal(windows, stream[: (len(stream) // 16) * 16].view(-1, 16))


def test_a_requested_shape_picks_seeded_windows_in_stream_order():
    stream = ROWS.reshape(-1)
    chunks = stream.view(-1, 16)
    a = calibration_tokens(DataLoader(list(ROWS), batch_size=2), None, num_samples=5, seq_len=16, seed=3).input_ids
    b = calibration_tokens(ROWS.tolist(), None, num_samples=5, seq_len=16, seed=3).input_ids
    assert torch.equal(a, b) and a.shape == (5, 16)
    picked = [next(i for i in range(len(chunks)) if torch.equal(chunks[i], row)) for row in a]
    assert picked == sorted(set(picked))  # distinct whole chunks, kept in stream order
    assert not torch.equal(a, calibration_tokens(ROWS, None, num_samples=5, seq_len=16, seed=4).input_ids)


def test_text_containers(tiny_llama_dir):
    """Strings, chat conversations (rendered by transformers' apply_chat_template), {"text"} records,
    a Dataset with text or messages: each tokenized as the text it stands for."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert tok.chat_template
    texts = [f"Document {i}: the quick brown fox jumps over the lazy dog number {i}." for i in range(40)]
    chats = [[{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": f"{2 * i}."}]
             for i in range(40)]
    shape = dict(num_samples=4, seq_len=32, seed=0)
    plain = calibration_tokens(texts, tok, **shape)
    for same in (tuple(texts), datasets.Dataset.from_dict({"text": texts}), [{"text": t} for t in texts],
                 (t for t in texts)):
        assert torch.equal(calibration_tokens(same, tok, **shape).input_ids, plain.input_ids)
    rendered = [tok.apply_chat_template(c, tokenize=False) for c in chats]
    assert "<|im_start|>" in rendered[0]
    oracle = calibration_tokens(rendered, tok, **shape)
    for conv in (chats, datasets.Dataset.from_dict({"messages": chats}), [{"messages": c} for c in chats]):
        got = calibration_tokens(conv, tok, **shape)
        assert torch.equal(got.input_ids, oracle.input_ids)
    assert "chat conversations" in calibration_tokens(chats, tok, **shape).source
    tokenized = datasets.Dataset.from_dict({"text": texts, "input_ids": ROWS.tolist()[:1] * 40})
    assert torch.equal(calibration_tokens(tokenized, tok).input_ids, ROWS[:1].repeat(40, 1))  # input_ids wins


@pytest.mark.parametrize("source, message", [
    (torch.zeros(3, 4), "token ids must be integers"),
    (torch.zeros(2, 2, 2, dtype=torch.long), "shape \\[2, 2, 2\\]"),
    ([{"labels": ROWS}], "no 'input_ids'"),
    (DataLoader(TensorDataset(ROWS, ROWS), batch_size=2), "group of 2 tensors"),
    ([], "is empty"),
    ({"input_ids": ROWS, "attention_mask": torch.ones(6, 31)}, "differ in shape"),
    (42, "unsupported dataset of type int"),
    (datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}), "one split"),
])
def test_bad_containers_get_one_line(source, message):
    with pytest.raises(QuantkitError, match=message) as err:
        calibration_tokens(source, None)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- quantize


def test_in_memory_model_and_dataloader_write_the_folder_and_list_bytes(tiny_llama_dir, tmp_path):
    """The issue's check: an in-memory model with a DataLoader of {"input_ids"} batches and the path
    with a list of the same rows write byte-identical safetensors; the model passed in is untouched."""
    from_path = quantkit.quantize(str(tiny_llama_dir), dataset=list(ROWS), output=tmp_path / "path", **GPTQ)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).train()  # a flag the copy must not touch
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loader = DataLoader([{"input_ids": r, "attention_mask": torch.ones_like(r)} for r in ROWS], batch_size=4)
    in_memory = quantkit.quantize(model, dataset=loader, output=tmp_path / "memory", **GPTQ)

    assert file_sha(tmp_path / "path") == file_sha(tmp_path / "memory")
    assert {k: v for k, v in model.state_dict().items()}.keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # left untouched
    assert not hasattr(model.config, "source_dtype") and model.training
    assert isinstance(in_memory, quantkit.api.QuantizeResult)
    assert in_memory.output == tmp_path / "memory" and in_memory.metrics is None
    assert in_memory.plan.recipe.name == "gptq" and in_memory["format"] == "gptq"  # the mapping is the summary
    c = in_memory.plan.calibration
    assert (c.num_samples, c.seq_len, c.tokens_sha256) == (6, 32, tokens_sha256(ROWS))
    for folder in (tmp_path / "path", tmp_path / "memory"):
        assert card_line(folder, "calibration_tokens_sha256") == tokens_sha256(ROWS)
        assert (card_line(folder, "num_samples"), card_line(folder, "seq_len")) == ("6", "32")
    assert card_line(tmp_path / "memory", "calibration").startswith("DataLoader of 2 batches: 6 token rows")
    assert from_path.plan.calibration.label().startswith("list of 6 items")
    # the tokenizer came from the model's folder and was written next to the weights
    assert (tmp_path / "memory" / "tokenizer.json").is_file()


def test_texts_and_conversations_calibrate(tiny_llama_dir, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    texts = [f"Paragraph {i}: calibration text about rivers, mountains and the sea, item {i}." for i in range(30)]
    chats = [[{"role": "user", "content": t}, {"role": "assistant", "content": "Noted."}] for t in texts]
    shape = dict(num_samples=4, seq_len=32)
    for name, source in (("texts", texts), ("chats", chats)):
        result = quantkit.quantize(model, tokenizer=tok, dataset=source, output=tmp_path / name, **shape, **GPTQ)
        expected = calibration_tokens(source, tok, **shape)
        assert card_line(result.output, "calibration_tokens_sha256") == expected.sha256
        assert card_line(result.output, "calibration") == expected.source
    assert file_sha(tmp_path / "texts") != file_sha(tmp_path / "chats")  # different tokens, different weights


def test_an_in_memory_model_needs_a_tokenizer_for_text_and_the_card(tmp_path):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(QuantkitError, match="needs its tokenizer: pass tokenizer=") as err:
        quantkit.quantize(model, "rtn", output=tmp_path / "x", progress=False)
    assert "\n" not in str(err.value) and not (tmp_path / "x").exists()


def test_in_memory_refusals(tiny_llama_dir, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with pytest.raises(QuantkitError, match="drop nproc"):
        quantkit.quantize(model, "rtn", nproc=2, output=tmp_path / "a", progress=False)
    with pytest.raises(QuantkitError, match="already in memory"):
        quantkit.quantize(model, "rtn", streaming=True, output=tmp_path / "b", progress=False)
    with pytest.raises(QuantkitError, match="PreTrainedModel"):
        quantkit.quantize(torch.nn.Linear(4, 4), "rtn", output=tmp_path / "c", progress=False)
    with pytest.raises(QuantkitError, match="outside the model's vocabulary"):
        quantkit.quantize(model, dataset=[[5, 6, 49152, 7]], output=tmp_path / "d", **GPTQ)
    assert not any(tmp_path.iterdir())  # nothing written or left half-written


def test_path_objects_and_rtn_in_memory(tiny_llama_dir, tmp_path):
    """A pathlib.Path model works like its string; an in-memory model with a method that reads no data
    writes the same bytes as its folder."""
    a = quantkit.quantize(Path(tiny_llama_dir), "rtn", group_size=32, output=tmp_path / "a", progress=False)
    b = quantkit.quantize(transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir), "rtn", group_size=32,
                          output=tmp_path / "b", progress=False)
    assert a.plan.calibration is None and file_sha(a.output) == file_sha(b.output)


@pytest.mark.slow  # ~20 s: scores the checkpoint on the whole held-out split
def test_eval_after_reports_quality_for_an_in_memory_model(tiny_llama_dir, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    result = quantkit.quantize(model, "rtn", group_size=32, output=tmp_path / "q", progress=False, eval_after=True)
    assert result.metrics is not None and result.metrics["held-out perplexity"] > 1
    assert "KL divergence to the original (mean per token)" not in result.metrics  # no folder to score against
    assert "held-out perplexity" in (tmp_path / "q" / "README.md").read_text()
    assert result["metrics"] == result.metrics


def test_token_rows_need_no_num_samples_or_seq_len(tiny_llama_dir, tmp_path):
    """The issue: tensors worked only with num_samples and seq_len given. Now the rows size the run;
    np arrays and BatchEncodings calibrate too."""
    batch = transformers.BatchEncoding({"input_ids": ROWS[:3], "attention_mask": torch.ones(3, 32, dtype=torch.long)})
    for i, source in enumerate((ROWS, np.asarray(ROWS), batch)):
        r = quantkit.quantize(str(tiny_llama_dir), dataset=source, output=tmp_path / str(i), **GPTQ)
        assert r.plan.calibration.num_samples == (3 if i == 2 else 6) and r.plan.calibration.seq_len == 32
