"""Models for the MoE scripts (bench_moe.py, moe_calibration_policy.py): written to a folder with the
demo tokenizer, so quantkit and the peer calibrate on real text tokens.

- `random_qwen3_moe`: a random Qwen3-MoE-shaped model (every layer sparse, norm_topk_prob).
- `upcycled_mixtral`: the demo SmolLM2-135M-Instruct (a trained Llama) turned into a Mixtral by
  "sparse upcycling": every layer's MLP copied into each expert with a small independent
  perturbation, and a random router. Mixtral renormalises its top-k weights, so the model computes
  nearly what the trained dense model computes (a trained-ish MoE, its perplexity near SmolLM2's),
  while each expert is calibrated on its own routed tokens. Every expert is alike, so routing matters little.
- `moefied_qwen2_moe`: the demo split into a Qwen2-MoE whose routed experts are disjoint groups of its
  trained neurons that fire together and whose router is fit to pick them: specialised experts and
  content-driven, uneven loads, the closest to a trained MoE that fits a 2-core box.
"""
from __future__ import annotations

from pathlib import Path


def _save(model, folder: Path, tokenizer_from: Path) -> Path:
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(folder)
    return folder


def _dense_fields(c) -> dict:
    """What an MoE built from the dense Llama config `c` keeps of it: vocabulary, widths, depth, attention,
    norms, rope, tying, special tokens."""
    return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                rms_norm_eps=c.rms_norm_eps, rope_parameters=c.rope_parameters, tie_word_embeddings=c.tie_word_embeddings,
                bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)


def _copy_all_but_mlps(moe, src, may_miss: tuple[str, ...] = ()) -> None:
    """Load every tensor of `src` except its MLPs into `moe`; anything else `moe` then lacks (beyond its MLPs,
    a tied head and keys ending in `may_miss`) is an error."""
    state = {k: v for k, v in src.state_dict().items() if ".mlp." not in k}
    missing = set(moe.load_state_dict(state, strict=False).missing_keys)
    expected = {k for k in missing if ".mlp." in k or k.endswith(may_miss)}
    expected |= {"lm_head.weight"} if src.config.tie_word_embeddings else set()
    assert missing <= expected, sorted(missing - expected)[:3]


def random_qwen3_moe(folder: Path, *, tokenizer_from: Path, layers: int = 8, experts: int = 16, top_k: int = 2,
                     hidden: int = 512, moe_intermediate: int = 256, heads: int = 8, kv_heads: int = 4,
                     router_std: float = 0.1, seed: int = 0) -> Path:
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(vocab_size=49152, hidden_size=hidden, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      head_dim=hidden // heads, moe_intermediate_size=moe_intermediate,
                                      intermediate_size=4 * moe_intermediate, num_experts=experts,
                                      num_experts_per_tok=top_k, norm_topk_prob=True, max_position_embeddings=2048,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, router_std)  # the 0.02 init routes by near-ties
    return _save(model, Path(folder), tokenizer_from)


def upcycled_mixtral(folder: Path, *, dense: Path, experts: int = 8, top_k: int = 2, noise: float = 0.05,
                     router_std: float = 0.1, seed: int = 0) -> Path:
    import torch
    import transformers

    torch.manual_seed(seed)
    src = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    c = src.config
    cfg = transformers.MixtralConfig(**_dense_fields(c), head_dim=c.head_dim, num_local_experts=experts,
                                     num_experts_per_tok=top_k, sliding_window=None)
    moe = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _copy_all_but_mlps(moe, src)
    with torch.no_grad():
        for layer, dense_layer in zip(moe.model.layers, src.model.layers):
            mlp = dense_layer.mlp
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            for e in range(experts):
                layer.mlp.experts.gate_up_proj[e] = gate_up * (1 + noise * torch.randn_like(gate_up))
                layer.mlp.experts.down_proj[e] = mlp.down_proj.weight * (1 + noise * torch.randn_like(mlp.down_proj.weight))
            layer.mlp.gate.weight.normal_(0.0, router_std)
    return _save(moe.to(torch.bfloat16), Path(folder), dense)  # the demo model's own storage dtype


def _balanced_clusters(features, groups: int, iters: int = 20, seed: int = 0):
    """Rows of ``features`` split into ``groups`` clusters of equal size (k-means, capacity-limited greedy
    assignment: the most confident row-centroid pairs are placed first)."""
    import torch

    n = features.shape[0]
    size = n // groups
    assert size * groups == n, (n, groups)
    x = torch.nn.functional.normalize(features, dim=1)
    gen = torch.Generator().manual_seed(seed)
    centroids = x[torch.randperm(n, generator=gen)[:groups]]
    for _ in range(iters):
        sim = x @ centroids.T
        assign = torch.full((n,), -1, dtype=torch.long)
        room = [size] * groups
        for flat in torch.argsort(sim.flatten(), descending=True).tolist():
            row, g = divmod(flat, groups)
            if assign[row] < 0 and room[g] > 0:
                assign[row] = g
                room[g] -= 1
        centroids = torch.nn.functional.normalize(torch.stack([x[assign == g].mean(0) for g in range(groups)]), dim=1)
    return [torch.nonzero(assign == g).flatten() for g in range(groups)]


def moefied_qwen2_moe(folder: Path, *, dense: Path, experts: int = 6, top_k: int = 2, shared_fraction: float = 0.75,
                      fit_tokens: int = 4096, router_spread: float = 0.1) -> Path:
    """The demo SmolLM2-135M (a trained Llama) split into a Qwen2-MoE ("MoEfication", Zhang et al. 2022).

    Per layer, the MLP's neurons are measured on ``fit_tokens`` wiki calibration tokens (never the Lee text
    the policies calibrate and score on): the most important ``shared_fraction`` (mean |activation| times
    the norm of its down_proj column) become the shared expert, the rest are clustered by co-activation
    into ``experts`` equal routed experts, and the router is the least-squares map from the MLP input to
    each expert's activation mass. So the experts hold trained neurons that fire on different tokens and
    the router picks by content with uneven loads, as in a trained MoE (unlike random or upcycled
    experts), while the model stays close to SmolLM2. Scales keep the sum: the shared expert's gate is
    zero (sigmoid 1/2, its down_proj doubled) and the top-k weights are renormalised (down_proj x top_k).
    """
    import torch
    import transformers

    from quantkit.data import calibration_batches

    src = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(dense)
    ids = calibration_batches("wiki", tok, num_samples=fit_tokens // 256, seq_len=256)
    inputs: dict[int, list] = {}
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: inputs.setdefault(i, []).append(a[0].reshape(-1, a[0].shape[-1])))
             for i, layer in enumerate(src.model.layers)]
    with torch.no_grad():
        for row in ids:
            src(row.reshape(1, -1))
    for h in hooks:
        h.remove()

    c = src.config
    width = c.intermediate_size
    shared = int(width * shared_fraction)
    routed = (width - shared) // experts
    cfg = transformers.Qwen2MoeConfig(**_dense_fields(c), hidden_act=c.hidden_act, num_experts=experts,
                                      num_experts_per_tok=top_k, moe_intermediate_size=routed,
                                      shared_expert_intermediate_size=shared, norm_topk_prob=True, qkv_bias=False,
                                      decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    moe = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _copy_all_but_mlps(moe, src, may_miss=("_proj.bias",))
    with torch.no_grad():
        for i, (layer, dense_layer) in enumerate(zip(moe.model.layers, src.model.layers)):
            mlp, block = dense_layer.mlp, layer.mlp
            x = torch.cat(inputs[i])
            act = (mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)).abs() * mlp.down_proj.weight.norm(dim=0)
            order = torch.argsort(act.mean(0), descending=True)
            keep, rest = order[:shared], order[shared:shared + routed * experts]
            for name, rows in (("gate_proj", keep), ("up_proj", keep)):
                getattr(block.shared_expert, name).weight.copy_(getattr(mlp, name).weight[rows])
            block.shared_expert.down_proj.weight.copy_(2 * mlp.down_proj.weight[:, keep])
            block.shared_expert_gate.weight.zero_()
            clusters = [rest[g] for g in _balanced_clusters(act[:, rest].T, experts)]
            for e, rows in enumerate(clusters):
                block.experts.gate_up_proj[e] = torch.cat([mlp.gate_proj.weight[rows], mlp.up_proj.weight[rows]])
                block.experts.down_proj[e] = top_k * mlp.down_proj.weight[:, rows]
            mass = torch.stack([act[:, rows].sum(1) for rows in clusters], dim=1)
            mass = (mass - mass.mean(1, keepdim=True)) / mass.std(1, keepdim=True).clamp_min(1e-6)
            router = torch.linalg.lstsq(x, mass).solution.T  # [experts, hidden]
            block.gate.weight.copy_(router * router_spread / (x @ router.T).std().clamp_min(1e-6))
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if proj.bias is not None:
                    proj.bias.zero_()
    return _save(moe.to(torch.bfloat16), Path(folder), dense)
