"""Models bigger than one device: accelerate's device map places each decoder layer (quantkit.placement).

Without a GPU only host memory and disk can be exercised: layers in host memory are read once,
layers on disk are streamed, and the checkpoint is the one a plain run writes. GPU placement (a
layer read onto its GPU and calibrated there) needs CUDA: `_home` is checked on a map that names
GPUs, the rest is left to a machine that has them.
"""
from __future__ import annotations

import pytest
import torch

from conftest import last_json, run_cli
from test_robustness import random_llama_with_demo_tokenizer, tree_sha256

from quantkit.errors import QuantkitError
from quantkit.placement import DISK, _home, parse_max_memory


def test_a_layer_lives_where_its_closest_listed_module_does():
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": 0, "model.layers.1": 1, "model.layers.2": "cpu",
                  "model.layers.3": "disk", "model.norm": "disk", "lm_head": "disk"}
    homes = [_home(device_map, f"model.layers.{i}") for i in range(4)]
    assert homes == [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu"), DISK]
    assert _home({"": 0}, "model.layers.7") == torch.device("cuda", 0)  # the whole model on one GPU
    assert _home({"model.layers.0.self_attn": 0, "model.layers.0.mlp": 0}, "model.layers.0") == torch.device("cuda", 0)
    with pytest.raises(QuantkitError, match="split decoder layer"):
        _home({"model.layers.0.self_attn": 0, "model.layers.0.mlp": "cpu"}, "model.layers.0")


def test_max_memory_is_read_as_accelerate_takes_it():
    assert parse_max_memory("0=70GiB, 1=70GiB,cpu=200GiB") == {0: "70GiB", 1: "70GiB", "cpu": "200GiB"}
    assert parse_max_memory(None) is None
    with pytest.raises(QuantkitError, match="DEVICE=SIZE"):
        parse_max_memory("70GiB")


@pytest.fixture(scope="module")
def six_layer_llama(tmp_path_factory):
    return random_llama_with_demo_tokenizer(tmp_path_factory, "placed-llama", layers=6, hidden=128, intermediate=384,
                                            layers_per_shard=3, seed=1)


def test_layers_in_host_memory_and_on_disk_write_the_plain_checkpoint(tmp_path, six_layer_llama):
    """28 MB of host memory holds the 25 MB embedding and two decoder layers: accelerate puts the
    other four on disk, from where they are streamed. The checkpoint is the plain run's, byte for byte."""
    args = ["--model", six_layer_llama, "--method", "gptq", "--group-size", "32", "--num-samples", "8",
            "--seq-len", "64", "--json"]
    plain = run_cli("quantize", *args, "--output", tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    placed = run_cli("quantize", *args, "--device-map", "auto", "--max-memory", "cpu=28MB", "--output", tmp_path / "placed")
    assert placed.returncode == 0, placed.stderr[-3000:]
    assert last_json(placed.stdout)["placement"] == {"cpu": 2, "disk": 4}
    assert tree_sha256(tmp_path / "placed") == tree_sha256(tmp_path / "plain")
    refused = run_cli("quantize", *args, "--device-map", "balanced", "--output", tmp_path / "other")
    assert refused.returncode == 2 and "--device-map takes 'auto'" in refused.stderr
