"""Speculative decoding (quantkit.engine.speculative): the acceptance rule against the target's
exact distribution (chi-square), greedy output against the target alone and transformers' generate
with drafts bad enough that tokens are rejected and their KV slots rolled back, the KV pools back
to full and prefix-cache hits still right afterwards, the n-gram and model proposers, and the
CLI/API surface. The ``slow`` tests run the demo model with its int4 self-draft."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

from quantkit.engine import LLMEngine, SamplingParams
from quantkit.engine import rejection_sampler as rs
from quantkit.engine.proposers import NgramProposer
from quantkit.engine.sequence import Sequence
from quantkit.engine.speculative import check_same_tokenizer
from quantkit.errors import QuantkitError
from tiny_models import FAMILIES, VOCAB, assert_pool_full, greedy, hf_greedy, prompts, tiny_model


pytestmark = pytest.mark.usefixtures("one_thread")


# ====================================================================== the acceptance rule
def chi2_sf(stat: float, df: int) -> float:
    """P(chi-square with df degrees of freedom > stat): the regularized upper incomplete gamma."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def pooled_chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit with the cells expected fewer than `min_expected` times pooled into
    one (the usual validity rule: one observation in a cell expected 0.001 times would otherwise
    add ~1000 to the statistic on its own)."""
    small = expected < min_expected
    obs = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    stat = float(((obs - exp) ** 2 / exp).sum())
    return chi2_sf(stat, obs.numel() - 1)


def first_two_tokens(p: torch.Tensor, q: torch.Tensor, n: int, seed: int, one_hot: bool) -> torch.Tensor:
    """Counts [V * V] of the first two tokens emitted by n independent streams under rejection
    sampling with K = len(q) draft tokens. The target is p[j] at stream position j, whatever came
    before (so the exact joint law is p[0] x p[1]); the draft proposes from q[j] (or, ``one_hot``,
    deterministic tokens with no distribution, as n-gram lookup). A stream whose first step emits
    only one token takes a second step from position 1, as the engine would."""
    g = torch.Generator().manual_seed(seed)
    K, V = q.shape

    def step(first_pos: int, m: int):
        qs = q[first_pos:]
        k = qs.shape[0]
        drafts = torch.stack([torch.multinomial(qs[j], m, replacement=True, generator=g) for j in range(k)], 1)
        count, tok = rs.rejection_sample(p[first_pos:first_pos + k + 1].expand(m, k + 1, V),
                                         None if one_hot else qs.expand(m, k, V), drafts, torch.full((m,), k),
                                         torch.rand(m, k, generator=g), g)
        return drafts, count, tok

    drafts, count, tok = step(0, n)
    first = torch.where(count > 0, drafts[:, 0], tok)
    second = torch.where(count > 1, drafts[:, 1], tok)
    again = (count == 0).nonzero().squeeze(-1)
    d2, c2, t2 = step(1, again.numel())
    second[again] = torch.where(c2 > 0, d2[:, 0], t2)
    return torch.bincount(first * V + second, minlength=V * V).double()


def _chi_square_against_target(monkeypatch=None, **wrong) -> list[float]:
    V, K, n = 6, 3, 60_000
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)  # a biased draft: ~half its mass misplaced
    assert (p[:K] - q).abs().sum(-1).min() > 0.5
    for name, fn in wrong.items():
        monkeypatch.setattr(rs, name, fn)
    expected = (p[0][:, None] * p[1][None, :]).reshape(-1).double() * n
    pvalues = []
    for one_hot in (False, True):
        observed = first_two_tokens(p, q, n, seed=0, one_hot=one_hot)
        stat = float(((observed - expected) ** 2 / expected).sum())
        pvalues.append(chi2_sf(stat, V * V - 1))
    return pvalues


def test_rejection_sampling_keeps_the_target_distribution():
    """60k streams, 36 cells (first two tokens), drafts from a biased q and one-hot drafts: the
    emitted tokens follow the target's law (chi-square p-value above 0.001 at a fixed seed)."""
    assert min(_chi_square_against_target()) > 1e-3


@pytest.mark.parametrize("rule", ["resample_from_target", "keep_with_p", "keep_90_percent"])
def test_chi_square_has_the_power_to_catch_a_wrong_acceptance_rule(monkeypatch, rule):
    """The same test with the rule broken the usual ways fails by a wide margin (p-values < 1e-12),
    so the sample size above is enough to notice one."""
    wrong = {"resample_from_target": {"residual": lambda p, q: p},
             "keep_with_p": {"keeps": lambda u, p_x, q_x: u < p_x},
             "keep_90_percent": {"keeps": lambda u, p_x, q_x: u * torch.maximum(q_x, p_x) < 0.9 * p_x}}[rule]
    assert max(_chi_square_against_target(monkeypatch, **wrong)[:1 if rule == "keep_with_p" else 2]) < 1e-12


def test_accept_greedy_and_residual():
    assert rs.accept_greedy([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert rs.accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert rs.accept_greedy([4], []) == [4]
    p, q = torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.2, 0.5, 0.3]])
    torch.testing.assert_close(rs.residual(p, q), torch.tensor([[1.0, 0.0, 0.0]]))
    torch.testing.assert_close(rs.residual(p, p), p)  # nothing left: the target itself


# ====================================================================== proposers
def test_ngram_proposer_looks_up_the_longest_recent_match():
    prop = NgramProposer(min_n=1, max_n=3)
    seq = Sequence([1, 2, 3, 4, 9, 2, 3, 4, 7, 8, 2, 3], SamplingParams(max_tokens=8), 4)
    # "2 3" ends the sequence: the longest earlier match is "2 3" (no "8 2 3" before); most recent: 5..6 -> 4 7 8
    assert prop.propose([seq], [3]).tokens == [[4, 7, 8]]
    assert prop.propose([seq], [1]).tokens == [[4]]
    seq.append_token(4)  # now "2 3 4" matches twice; the most recent one (5..7) proposes 7 8 2
    assert prop.propose([seq], [5]).tokens == [[7, 8, 2, 3, 4]]
    other = Sequence([5, 6, 7], SamplingParams(max_tokens=8), 4)
    assert prop.propose([other, seq], [4, 0]).tokens == [[], []]  # no match; no budget
    prop.retain({seq.seq_id})
    assert set(prop.index) == {seq.seq_id}
    with pytest.raises(QuantkitError):
        NgramProposer(min_n=3, max_n=2)


def noisy_copy(model, noise: float, seed: int = 1):
    """The target with Gaussian noise (noise x each tensor's std) on every weight: a draft that agrees
    with it often, not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return draft


def record_proposals(proposer) -> list[tuple[list[int], int, list[int]]]:
    """Wrap ``proposer.propose`` to log (the sequence's tokens, its budget, the proposal) for every
    sequence of every step; returns the (growing) log."""
    log, propose = [], proposer.propose

    def record(seqs, budgets):
        out = propose(seqs, budgets)
        log.extend((list(s.token_ids), k, d) for s, k, d in zip(seqs, budgets, out.tokens))
        return out
    proposer.propose = record
    return log


def test_draft_model_proposals_are_its_own_greedy_continuations():
    """Every proposal equals the draft model's own greedy continuation (transformers generate) of
    the sequence so far: after a fresh prefill, and after catch-up steps of one token (a rejection)
    and of two (everything accepted, the last draft token never run by the draft)."""
    target = tiny_model("llama")
    draft = noisy_copy(target, 0.05)
    eng = LLMEngine(target, block_size=4, num_kv_blocks=40, draft=draft, num_speculative_tokens=3)
    proposer = eng.speculative.proposer
    log = record_proposals(proposer)
    eng.generate(prompts(2, [6, 11], seed=3), greedy(16))
    seen = [(context, proposal) for context, _, proposal in log if proposal]
    assert len(seen) > 8
    for context, proposal in seen:
        assert proposal == hf_greedy(draft, context, len(proposal))
    m = eng.get_metrics()
    assert 0 < m["accepted_tokens"] < m["draft_tokens"]
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks
    assert not proposer.states


def test_the_draft_reads_the_prompt_in_the_prefill_step():
    """The draft's pass over a prompt is prefill work: after the prefill step its cache holds the
    prompt, so the first speculative step catches it up on one token (the target's first); a request
    that ends at its first token leaves nothing in the draft's pool."""
    target = tiny_model("llama")
    eng = LLMEngine(target, block_size=4, num_kv_blocks=40, draft=noisy_copy(target, 0.05), num_speculative_tokens=3)
    proposer = eng.speculative.proposer
    p = prompts(1, [9], seed=5)[0]
    eng.add_request(p, greedy(6))
    eng.step()  # the prefill
    (state,) = proposer.states.values()
    assert state.computed == len(p) and state.shadow.token_ids == p
    caught_up, run_extend = [], proposer.runner.run_extend

    def record(reqs, **kw):
        caught_up.append([len(r.token_ids) for r in reqs])
        return run_extend(reqs, **kw)
    proposer.runner.run_extend = record
    eng.step()
    assert caught_up[0] == [1]
    while not eng.is_finished():
        eng.step()
    eng.generate([p], greedy(1))
    assert not proposer.states
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks


def test_draft_confidence_stops_drafting_where_the_draft_is_unsure():
    """With ``draft_confidence`` a sequence stops drafting once the draft's probability for its latest
    token is below it: proposals are cut exactly after the first such token (checked against the
    draft's own softmax from transformers' forward), never where the draft is sure, and the
    greedy output is still the target's. Refused without a draft model, and outside [0, 1)."""
    target = tiny_model("llama")
    draft = noisy_copy(target, 0.05)
    ps = prompts(2, [6, 11], seed=3)
    want = [hf_greedy(target, p, 16) for p in ps]
    threshold = 0.03  # the random tiny model's top probabilities (0.02-0.08) straddle it
    eng = LLMEngine(target, block_size=4, num_kv_blocks=40, draft=draft, num_speculative_tokens=4,
                    draft_confidence=threshold)
    log = record_proposals(eng.speculative.proposer)
    assert [g["token_ids"] for g in eng.generate(ps, greedy(16))] == want
    cut = full = 0
    for context, budget, proposal in (entry for entry in log if entry[1]):
        with torch.no_grad():
            logits = draft(torch.tensor([context + proposal])).logits[0, len(context) - 1:]
        top = torch.softmax(logits.double(), -1).amax(-1)[:len(proposal)].tolist()
        assert proposal == hf_greedy(draft, context, len(proposal))
        assert all(t >= threshold for t in top[:-1]), (top, proposal)  # no stop before the last token
        if len(proposal) < budget:
            assert top[-1] < threshold, top  # stopped right after an unsure token
            cut += 1
        else:
            full += 1
    assert cut and full, (cut, full)
    with pytest.raises(QuantkitError, match="needs a draft model"):
        LLMEngine(target, block_size=4, num_kv_blocks=40, draft="ngram", draft_confidence=0.5)
    with pytest.raises(QuantkitError, match=r"in \[0, 1\)"):
        LLMEngine(target, block_size=4, num_kv_blocks=40, draft=draft, draft_confidence=1.0)


# ====================================================================== greedy = the target alone
BAD_DRAFTS = ["noisy", "other", "ngram"]


def make_draft(kind: str, target):
    if kind == "noisy":
        return noisy_copy(target, 0.05)
    if kind == "other":  # a different, smaller random model with the same vocabulary: rejects almost all
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=512)
        torch.manual_seed(7)
        return transformers.AutoModelForCausalLM.from_config(cfg).eval()
    return kind


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft_kind", BAD_DRAFTS)
def test_speculative_greedy_equals_target_alone(family, draft_kind):
    """Four requests, two running at a time (later ones join mid-decode), k = 1, 3 and 5: greedy
    tokens equal the target decoding alone and transformers' generate; tokens are rejected (their
    slots rolled back) as well as accepted; both KV pools end full."""
    target = tiny_model(family)
    draft = make_draft(draft_kind, target)
    ps = prompts(4, [5, 17, 2, 33], seed=1) if draft_kind != "ngram" else \
        [p + p[:9] for p in prompts(4, [5, 17, 2, 33], seed=1)]  # repeats: something for the lookup to find
    max_new = [9, 4, 12, 7]
    want = [hf_greedy(target, p, n) for p, n in zip(ps, max_new)]
    for k in (1, 3, 5):
        eng = LLMEngine(target, block_size=4, num_kv_blocks=40, max_num_seqs=2, draft=draft, num_speculative_tokens=k)
        got = eng.generate(ps, [greedy(n) for n in max_new])
        assert [g["token_ids"] for g in got] == want, k
        m = eng.get_metrics()
        assert m["draft_tokens"] > m["accepted_tokens"], "no rejection: the rollback path went untested"
        if draft_kind == "noisy":
            assert m["accepted_tokens"] > 0 and m["decode_steps"] < sum(max_new) - 4
        assert m["output_tokens"] == sum(max_new)
        assert_pool_full(eng)
        if draft_kind != "ngram":
            dbm = eng.speculative.proposer.block_manager
            assert dbm.num_free_blocks == dbm.num_blocks


def test_speculative_with_preemption_and_eos():
    """A pool too small for all requests at once (sequences are preempted and recomputed mid-way)
    and an EOS inside an accepted run (the step's later tokens are dropped): same tokens as the
    target alone."""
    target = tiny_model("llama")
    draft = noisy_copy(target, 0.03)
    ps = prompts(3, [6, 3, 9], seed=2)
    alone = LLMEngine(target, block_size=4, num_kv_blocks=40)
    want = [g["token_ids"] for g in alone.generate(ps, greedy(14))]
    eng = LLMEngine(target, block_size=4, num_kv_blocks=6, max_num_seqs=3, draft=draft, num_speculative_tokens=4)
    got = eng.generate(ps, greedy(14))
    assert [g["token_ids"] for g in got] == want
    assert eng.get_metrics()["num_preemptions"] > 0
    assert_pool_full(eng)
    stop = want[0][5]  # a token the first request emits: it must end that request exactly there
    eng = LLMEngine(target, block_size=4, num_kv_blocks=40, draft=draft, num_speculative_tokens=4)
    got = eng.generate(ps[:1], greedy(14, stop_token_ids=[stop]))[0]
    assert got["token_ids"] == want[0][:want[0].index(stop) + 1] and got["finish_reason"] == "stop"
    assert_pool_full(eng)


def test_prefix_cache_stays_right_after_speculative_runs():
    """After speculative runs with rejections, the pool is full again and a request whose prompt is
    an earlier request's prompt + output hits the blocks that accepted draft tokens filled, and
    decodes what a cold engine without prefix caching decodes."""
    target = tiny_model("llama")
    eng = LLMEngine(target, block_size=4, num_kv_blocks=40, draft=noisy_copy(target, 0.05), num_speculative_tokens=3)
    first = prompts(1, [7], seed=4)[0]
    out = eng.generate([first], greedy(18))[0]["token_ids"]
    assert 0 < eng.get_metrics()["accepted_tokens"] < eng.get_metrics()["draft_tokens"]
    assert_pool_full(eng)
    follow = first + out[:16] + [9, 10]  # 25 tokens: the first 6 blocks were filled by the first request
    eng.reset_metrics()
    again = eng.generate([follow], greedy(6))[0]["token_ids"]
    m = eng.get_metrics()
    assert m["prefix_hit_blocks"] == 5, m  # blocks 0-4 hold committed tokens whose K/V was written
    cold = LLMEngine(target, block_size=4, num_kv_blocks=40, enable_prefix_caching=False)
    assert again == cold.generate([follow], greedy(6))[0]["token_ids"] == hf_greedy(target, follow, 6)
    assert_pool_full(eng)


# ====================================================================== sampling through the engine
@pytest.mark.filterwarnings("ignore:quantkit cpu backend")  # an 8-token head: no int4 kernel for it
@pytest.mark.parametrize("draft_head,confidence", [(None, 0.0), ("shortlist", 0.0), (None, 0.3)])
def test_speculative_sampling_through_the_engine_follows_the_target(monkeypatch, draft_head, confidence):
    """3000 copies of one prompt sampled at temperature 1 with a noisy draft (k = 2): the joint laws
    of the first two new tokens (the second from a speculative step) and of the second and third
    match the target's exact p(t1) p(t2 | t1) and sum_t1 p(t1) p(t2 | t1) p(t3 | t1, t2) from
    transformers' forward (chi-square over 8 x 8 cells each, those expected < 5 times pooled), also
    when the draft samples from a shortlist of 3 of the 8 tokens (its LM head "shortlist", cut to 3
    here) and when it stops drafting below a confidence of 0.3 (then some steps propose 1 token,
    some 2). A seeded request gives the same tokens twice."""
    from quantkit.engine import quantized_head

    monkeypatch.setattr(quantized_head, "SHORTLIST", 3)
    V, n = 8, 3000
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=V, max_position_embeddings=64,
                                   initializer_range=0.5)
    torch.manual_seed(3)
    target = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    draft = noisy_copy(target, 0.5)
    prompt = [1, 5, 2, 6]
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)
        p2 = torch.softmax(target(torch.tensor([prompt + [t] for t in range(V)])).logits[:, -1].double(), -1)
        p3 = torch.softmax(target(torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])).logits[:, -1]
                           .double(), -1).reshape(V, V, V)
    joint12 = p1[:, None] * p2
    laws = {(0, 1): joint12.reshape(-1) * n, (1, 2): (joint12[:, :, None] * p3).sum(0).reshape(-1) * n}
    eng = LLMEngine(target, block_size=4, num_kv_blocks=n * 2 + 8, max_num_seqs=n, draft=draft,
                    num_speculative_tokens=2, draft_lm_head_quant=draft_head, draft_confidence=confidence)
    if draft_head:  # the draft's distributions really are cut to the shortlist
        q = eng.speculative.proposer.runner.head(torch.randn(4, cfg.hidden_size))
        assert bool((torch.isfinite(q).sum(-1) == 3).all())
    log = record_proposals(eng.speculative.proposer)
    torch.manual_seed(0)
    outs = eng.generate([prompt] * n, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
    lengths = [(budget, len(proposal)) for _, budget, proposal in log]  # per sequence-step
    m = eng.get_metrics()
    assert 0.2 < m["acceptance_rate"] < 0.9, m["acceptance_rate"]
    stopped = sum(length < budget for budget, length in lengths)
    ran_on = sum(length == budget == 2 for budget, length in lengths)
    assert (stopped > n // 10 and ran_on > n // 10) if confidence else (stopped == 0 and ran_on > n // 2), \
        (stopped, ran_on)
    for (i, j), expected in laws.items():
        pairs = torch.tensor([o["token_ids"][i] * V + o["token_ids"][j] for o in outs])
        observed = torch.bincount(pairs, minlength=V * V).double()
        assert pooled_chi2_pvalue(observed, expected) > 1e-3, (i, j, observed, expected)
    assert_pool_full(eng)
    seeded = SamplingParams(temperature=0.8, top_k=5, max_tokens=12, seed=11)
    a = eng.generate([prompt], seeded)[0]["token_ids"]
    assert a == eng.generate([prompt], seeded)[0]["token_ids"]


# ====================================================================== bad input, API
def test_draft_tokenizer_mismatch_is_refused(demo_dir):
    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    other = transformers.AutoTokenizer.from_pretrained(demo_dir)
    other.add_tokens(["<quantkit-extra>"])
    check_same_tokenizer(tok, transformers.AutoTokenizer.from_pretrained(demo_dir), 49152, 49152)
    with pytest.raises(QuantkitError, match="tokenizer differs") as err:
        check_same_tokenizer(tok, other, 49152, 49152)
    assert "\n" not in str(err.value)
    with pytest.raises(QuantkitError, match="vocabulary"):
        check_same_tokenizer(None, None, 256, 512)
    target = tiny_model("llama")
    small = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=300))
    with pytest.raises(QuantkitError, match="vocabulary"):
        LLMEngine(target, num_kv_blocks=8, draft=small)
    with pytest.raises(QuantkitError, match="num_speculative_tokens"):
        LLMEngine(target, num_kv_blocks=8, draft="ngram", num_speculative_tokens=0)
    with pytest.raises(QuantkitError, match="not a model"):
        LLMEngine(target, num_kv_blocks=8, draft="medusa")


# ====================================================================== the demo model (slow)
DEMO_PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived",
                "def fibonacci(n):", "Summarise: The Eiffel Tower is a wrought-iron lattice tower in Paris. "
                "It is named after the engineer Gustave Eiffel, whose company designed and built the tower. "
                "Summary: The Eiffel Tower"]
DEMO_MAX_NEW = [24, 24, 16, 20]


def int4_copy(model, group_size: int = 64):
    """The model with every decoder linear replaced by its RTN int4 QuantLinear (cpu backend), in memory."""
    from quantkit.quantizers.grid import rtn_quantize
    from quantkit.runtime.quant_linear import QuantLinear

    draft = copy.deepcopy(model)
    for name, module in list(draft.model.layers.named_modules()):
        if isinstance(module, torch.nn.Linear):
            parent_name, _, attr = name.rpartition(".")
            qw = rtn_quantize(module.weight.data, 4, group_size, True, module.bias)
            setattr(draft.model.layers.get_submodule(parent_name), attr,
                    QuantLinear.from_quantized(qw, "gptq", dtype=torch.float32, backend="cpu"))
    return draft


@pytest.mark.slow
def test_demo_speculative_greedy_equals_transformers(demo_dir):
    """The fp32 demo with its own int4 copy as draft (k = 4) and with n-gram lookup (k = 3),
    continuous batching of four prompts two at a time: transformers' greedy tokens exactly."""
    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    ids = [tok(p).input_ids for p in DEMO_PROMPTS]
    want = [hf_greedy(model, p, n) for p, n in zip(ids, DEMO_MAX_NEW)]
    params = [greedy(n) for n in DEMO_MAX_NEW]
    for draft, k in ((int4_copy(model), 4), ("ngram", 3)):
        eng = LLMEngine(model, tok, max_num_seqs=2, num_kv_blocks=24, draft=draft, num_speculative_tokens=k,
                        draft_tokenizer=tok if draft != "ngram" else None)
        got = eng.generate(ids, params)
        assert [g["token_ids"] for g in got] == want
        m = eng.get_metrics()
        assert 0 < m["accepted_tokens"] < m["draft_tokens"], m
        assert_pool_full(eng)


@pytest.mark.slow
def test_cli_generate_and_bench_with_a_draft(tiny_llama_dir, tmp_path):
    """`generate`/`bench` --draft DIR|ngram --num-speculative-tokens K: the same tokens as without a
    draft, JSON with acceptance_rate, mean_accepted_tokens and tokens_per_s; a draft whose tokenizer
    differs exits 2 with one line."""
    from conftest import last_json, run_cli

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    noisy_copy(model, 0.05).save_pretrained(tmp_path / "draft")
    tok.save_pretrained(tmp_path / "draft")
    tok.add_tokens(["<quantkit-extra>"])
    noisy_copy(model, 0.05).save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    base = ["generate", "--model", tiny_llama_dir, "--prompt", "Hello there, how", "--max-new-tokens", "10", "--json"]
    plain = last_json(run_cli(*base).stdout)
    for draft in (tmp_path / "draft", "ngram"):
        r = run_cli(*base, "--draft", draft, "--num-speculative-tokens", "3")
        assert r.returncode == 0, r.stderr
        out = last_json(r.stdout)
        assert out["token_ids"] == plain["token_ids"]
        assert out["tokens_per_s"] > 0 and out["acceptance_rate"] is not None and "mean_accepted_tokens" in out
    r = run_cli("bench", "--model", tiny_llama_dir, "--batch-size", "2", "--input-len", "12", "--output-len", "6",
                "--draft", tmp_path / "draft", "--num-speculative-tokens", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = last_json(r.stdout)
    assert out["output_tokens"] == 12 and 0 <= out["acceptance_rate"] <= 1 and out["tokens_per_s"] > 0
    r = run_cli(*base, "--draft", tmp_path / "other")
    assert r.returncode == 2 and "tokenizer differs" in r.stderr and len(r.stderr.strip().splitlines()) == 1
