"""engine.static_step: the decode step from static buffers per batch-size bucket (replayed from a
CUDA graph on GPU; the GPU half is in tests/test_gpu.py). On CPU the same buffers, padding and
bucket choice run eagerly; the oracle is the eager engine (cuda_graph=False) on the same model:
identical greedy tokens, logits within fp32 rounding, and the same K/V in every block a sequence
used (padding rows write only to the scratch block)."""
from __future__ import annotations

import pytest
import torch

from quantkit.engine import LLMEngine
from quantkit.engine.sampler import Sampler
from quantkit.engine.static_step import batch_buckets, block_table_width, pick_bucket
from quantkit.errors import QuantkitError
from tiny_models import assert_pool_full, greedy, tiny_model, with_rtn_quantlinears
from tiny_models import prompts as _prompts

pytestmark = pytest.mark.usefixtures("one_thread")


class RecordingSampler(Sampler):
    """Greedy sampling that keeps every decode step's logits (prefill steps included, in order)."""

    def __init__(self):
        self.logits = []

    def __call__(self, logits, seqs):
        self.logits.append(logits.float().clone())
        return super().__call__(logits, seqs)


def test_buckets_and_bucket_choice():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(40) == (1, 2, 4, 8, 16, 32, 40)
    assert batch_buckets(10_000)[-1] == 512
    buckets = (1, 2, 4, 8)
    assert [pick_bucket(buckets, n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    assert block_table_width(512, 4, 1000) == 128  # the longest sequence's blocks
    assert block_table_width(512, 4, 20) == 20  # never more than the pool
    assert block_table_width(None, 4, 20) == 20
    assert block_table_width(10, 4, 20) == 3


def _run(model, prompts, max_tokens, cuda_graph, kv="auto"):
    eng = LLMEngine(model, block_size=4, num_kv_blocks=64, max_num_seqs=8, cuda_graph=cuda_graph,
                    graph_buckets=(1, 2, 4), kv_cache_dtype=kv)
    eng.sampler = RecordingSampler()
    outs = eng.generate(prompts, [greedy(n, ignore_eos=True) for n in max_tokens])
    return eng, [o["token_ids"] for o in outs]


@pytest.mark.parametrize("weights,kv", [("fp32", "auto"), ("int4", "auto"), ("fp32", "int8")])
def test_static_step_gives_the_eager_engines_tokens(weights, kv):
    """Batches of 6 (above the largest bucket: eager), then 5 ... 1 as requests finish at different
    lengths: 4 and 3 padded to the bucket 4, 2 and 1 exact. Tokens equal the eager engine's, every
    step's logits agree within fp32 rounding (the static step's attention is the reference over the
    block tables, the eager CPU step a gather over slots), and the K/V in the pool's blocks is the same."""
    model = tiny_model("llama")
    if weights == "int4":
        model = with_rtn_quantlinears(model)
    prompts = _prompts(6, [5, 9, 3, 12, 7, 4], seed=3)
    max_tokens = [3, 5, 7, 9, 11, 14]
    eager, want = _run(model, prompts, max_tokens, False, kv)
    static, got = _run(model, prompts, max_tokens, True, kv)
    assert eager.runner.static_step is None and static.runner.static_step is not None
    assert got == want
    assert len(static.sampler.logits) == len(eager.sampler.logits)
    for a, b in zip(static.sampler.logits, eager.sampler.logits):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    step = static.runner.static_step
    # 6 rows: eager (above the bucket 4); 5 rows: eager; 4, 3: bucket 4; 2: bucket 2; 1: bucket 1
    assert step.eager_fallbacks == 2 + 2 and step.steps_by_bucket == {1: 3, 2: 2, 4: 4}
    n = eager.runner.num_blocks
    assert static.kv_cache.k.shape[1] == n + 1 and step.scratch_block == n  # one scratch block past the manager's
    torch.testing.assert_close(static.kv_cache.k[:, :n], eager.kv_cache.k[:, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(static.kv_cache.v[:, :n], eager.kv_cache.v[:, :n], atol=1e-5, rtol=1e-5)
    assert_pool_full(static)
    assert_pool_full(eager)


def test_static_step_is_off_by_default_on_cpu_and_checks_its_buckets():
    model = tiny_model("llama")
    eng = LLMEngine(model, block_size=4, num_kv_blocks=16)
    assert eng.runner.static_step is None and eng.kv_cache.k.shape[1] == 16
    with pytest.raises(QuantkitError, match="graph_buckets"):
        LLMEngine(model, block_size=4, num_kv_blocks=16, cuda_graph=True, graph_buckets=(0, 2))
    eng = LLMEngine(model, block_size=4, num_kv_blocks=16, cuda_graph=True, max_num_seqs=6)
    assert eng.runner.static_step.buckets == (1, 2, 4, 6)
    assert eng.runner.static_step.buffers.logits.shape == (6, 256)
    assert eng.runner.static_step.buffers.block_tables.shape == (6, 16)  # 512 positions / 4 > 16 blocks


@pytest.mark.parametrize("int4", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_static_step_with_the_triton_kernels_under_the_interpreter(int4):
    """What a CUDA graph replays, short of the graph: the Triton paged-attention kernel reads the
    static block-table buffer (columns past a sequence's blocks stale from earlier steps) and the
    int4 linears run the Triton dequant GEMM, here in the Triton interpreter on CPU tensors (the int4
    case takes ~11 s on 2 cores: slow tier)."""
    from quantkit.kernels import triton_support

    if not triton_support.HAS_TRITON or not triton_support.INTERPRET:
        pytest.skip("triton interpreter not active")
    model = tiny_model("llama", num_hidden_layers=1)
    if int4:
        model = with_rtn_quantlinears(model, backend="triton")
    prompts = _prompts(3, [6, 3, 9], seed=2)
    max_tokens = [2, 4, 6]
    runs = {}
    for graphed in (False, True):
        eng = LLMEngine(model, block_size=4, num_kv_blocks=16, max_num_seqs=4, cuda_graph=graphed,
                        graph_buckets=(1, 2, 4), attention_backend="triton")
        assert eng.runner.use_triton
        runs[graphed] = eng, [o["token_ids"] for o in eng.generate(prompts, [greedy(n, ignore_eos=True) for n in max_tokens])]
        assert_pool_full(eng)
    assert runs[True][1] == runs[False][1]
    assert runs[True][0].runner.static_step.steps_by_bucket == {1: 2, 2: 2, 4: 1}


class FakeCuda:
    """Stands in for torch.cuda's graph API on CPU, with a graph's semantics: capture runs the step
    once and keeps it; replay re-runs it on the same static buffers (what a CUDA graph's kernels
    read and write). It lets the capture / replay control flow of engine.static_step run here."""

    def __init__(self, fail: bool = False):
        self.fail, self.capturing, self.graphs = fail, None, []

    class Graph:
        def __init__(self):
            self.fn, self.replays = None, 0

        def replay(self):
            self.replays += 1
            self.fn()

    def install(self, monkeypatch):
        from contextlib import contextmanager, nullcontext

        from quantkit.engine.static_step import StaticDecodeStep

        fake = self

        @contextmanager
        def graph(g, pool=None):
            fake.capturing = g
            try:
                if fake.fail:
                    raise RuntimeError("operation not permitted when stream is capturing\nmore")
                yield
            finally:
                fake.capturing = None

        def new_graph():
            g = FakeCuda.Graph()
            fake.graphs.append(g)
            return g

        forward = StaticDecodeStep._forward

        def recording_forward(step, bucket):
            if fake.capturing is not None:
                fake.capturing.fn = lambda: forward(step, bucket)
            return forward(step, bucket)

        stream = type("Stream", (), {"wait_stream": lambda self, other: None})
        for name, value in dict(CUDAGraph=new_graph, graph=graph, synchronize=lambda device=None: None,
                                Stream=lambda device=None: stream(), current_stream=lambda device=None: stream(),
                                stream=lambda s: nullcontext(), graph_pool_handle=lambda: object()).items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(StaticDecodeStep, "_forward", recording_forward)


@pytest.mark.parametrize("fail", [False, True])
def test_capture_and_replay_control_flow(monkeypatch, fail):
    """The CUDA path's control flow on CPU, torch.cuda's graph API faked (FakeCuda): one capture per
    bucket, on its first use, after a warm-up on padding rows (which writes to the scratch block
    only: the pool's K/V ends equal to the eager engine's); every later step of the bucket a replay on
    freshly filled buffers; tokens equal the eager engine's. A capture that fails leaves the engine
    on the static step run eagerly, with one notice, and the same tokens."""
    from quantkit.notices import reset_notices

    model = tiny_model("llama")
    prompts = _prompts(6, [5, 9, 3, 12, 7, 4], seed=3)
    max_tokens = [3, 5, 7, 9, 11, 14]
    eager, want = _run(model, prompts, max_tokens, False)
    fake = FakeCuda(fail)
    fake.install(monkeypatch)
    reset_notices()
    eng = LLMEngine(model, block_size=4, num_kv_blocks=64, max_num_seqs=8, cuda_graph=True, graph_buckets=(1, 2, 4))
    step = eng.runner.static_step
    step.use_graphs = True  # as on CUDA
    with pytest.warns(UserWarning, match="CUDA graph failed") if fail else _no_warning():
        got = [o["token_ids"] for o in eng.generate(prompts, [greedy(n, ignore_eos=True) for n in max_tokens])]
    assert got == want
    n = eager.runner.num_blocks
    torch.testing.assert_close(eng.kv_cache.k[:, :n], eager.kv_cache.k[:, :n], atol=1e-5, rtol=1e-5)
    assert step.steps_by_bucket == {1: 3, 2: 2, 4: 4}
    if fail:
        assert not step.use_graphs and step.graphs == {} and len(fake.graphs) == 1
    else:
        assert sorted(step.graphs) == [1, 2, 4] and len(fake.graphs) == 3  # one capture per bucket
        assert {b: g.replays for b, g in step.graphs.items()} == step.steps_by_bucket
    assert_pool_full(eng)


def _no_warning():
    import warnings
    from contextlib import contextmanager

    @contextmanager
    def ctx():
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            yield
    return ctx()


def test_cli_cuda_graph_flag_reaches_the_engine(tiny_llama_dir):
    """`generate` / `bench --cuda-graph` (on CPU: the static step run eagerly) give what
    `--no-cuda-graph` gives: the same greedy tokens, every requested token."""
    import json

    from click.testing import CliRunner

    from quantkit.cli import cli

    def run(*args):
        r = CliRunner().invoke(cli, [*args, "--model", str(tiny_llama_dir), "--json"])
        assert r.exit_code == 0, r.output
        return json.loads(r.output.strip().splitlines()[-1])

    static = run("generate", "--prompt", "Hello there", "--max-new-tokens", "6", "--cuda-graph")
    eager = run("generate", "--prompt", "Hello there", "--max-new-tokens", "6", "--no-cuda-graph")
    assert static["token_ids"] == eager["token_ids"] and len(static["token_ids"]) >= 1
    bench = run("bench", "--batch-size", "3", "--input-len", "8", "--output-len", "4", "--cuda-graph")
    assert bench["output_tokens"] == 12
