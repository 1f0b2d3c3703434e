"""Mixed precision to a budget (quantkit.allocation): the knapsack against brute force, the budget
as counted from the written files, the gptq `dynamic` rules as GPTQModel reads them, the mixture's
logits against a plain-PyTorch dequantization of the written tensors, the report's rows and pictures."""
from __future__ import annotations

import itertools
import json
import random
import re
import zlib

import pytest
import torch

from quantkit.allocation import knapsack
from quantkit.errors import QuantkitError

pytestmark = pytest.mark.usefixtures("one_thread")

PACKED = ("qweight", "qzeros", "scales", "g_idx")


# ------------------------------------------------------------------ knapsack

def brute_force(costs, values, budget):
    best = None
    for pick in itertools.product(*[range(len(c)) for c in costs]):
        if sum(c[j] for c, j in zip(costs, pick)) <= budget:
            v = sum(vs[j] for vs, j in zip(values, pick))
            best = v if best is None or v < best else best
    return best


@pytest.mark.parametrize("seed", range(30))
def test_knapsack_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    costs = [sorted(rng.sample(range(1, 40), rng.randint(1, 4))) for _ in range(n)]
    # cheaper candidates cost more KL, as quantization does, plus unordered noise
    values = [[rng.random() * 5 / c + rng.random() * 0.1 for c in row] for row in costs]
    lo, hi = sum(min(c) for c in costs), sum(max(c) for c in costs)
    budget = rng.randint(lo, hi)
    picks = knapsack.solve(costs, values, budget)
    assert sum(c[j] for c, j in zip(costs, picks)) <= budget
    assert sum(v[j] for v, j in zip(values, picks)) == pytest.approx(brute_force(costs, values, budget))


def test_knapsack_coarse_units_still_hold_the_budget():
    rng = random.Random(1)
    costs = [[rng.randint(1000, 5000) for _ in range(3)] for _ in range(8)]
    values = [[rng.random() for _ in row] for row in costs]
    budget = sum(min(c) for c in costs) + 4321
    picks = knapsack.solve(costs, values, budget, quantum=97)  # costs not multiples of the unit
    assert sum(c[j] for c, j in zip(costs, picks)) <= budget


def test_knapsack_refuses_a_budget_below_the_cheapest_choice():
    with pytest.raises(QuantkitError, match="smallest possible, 5 bytes"):
        knapsack.solve([[2, 3], [3, 4]], [[1, 0], [1, 0]], 4)


# ------------------------------------------------------------------ report, quantize with a budget

@pytest.fixture(scope="module")
def report_dir(tmp_path_factory, tiny_llama_dir):
    import quantkit.api as api

    out = tmp_path_factory.mktemp("sens") / "report"
    # candidates as bit widths at the run's group size, and one scheme label at another group size
    api.sensitivity(str(tiny_llama_dir), "gptq", group_size=32, num_samples=4, seq_len=32, eval_windows=2,
                    eval_seq_len=32, candidate_bits=(2, "w3g64", 4, 8), output=out, progress=False)
    return out


def _linears(folder):
    from safetensors import safe_open

    sizes, tensors = {}, {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                owner, _, leaf = key.rpartition(".")
                if leaf in PACKED:
                    t = st.get_tensor(key)
                    sizes[owner] = sizes.get(owner, 0) + t.numel() * t.element_size()
                    tensors.setdefault(owner, {})[leaf] = t
    return sizes, tensors


def test_report_has_one_row_per_linear_and_scheme_and_its_pictures(report_dir, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    report = json.loads((report_dir / "sensitivity.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    pairs = [(r["linear"], r["scheme"]) for r in report["rows"]]
    assert sorted(pairs) == sorted(itertools.product(linears, ["w2g32", "w3g64", "w4g32", "w8g32"]))
    for png in ("sensitivity_heatmap.png", "sensitivity_size_kl.png"):
        data = (report_dir / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        idat = data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8]
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert len(zlib.decompress(idat)) == height * (1 + 3 * width)  # filter byte + RGB per row
    page = (report_dir / "sensitivity.html").read_text()
    assert page.count("<svg") == 2 and "sensitivity.json" in page
    # every linear measured alone at every scheme, and that measurement is its prediction
    assert report["calibration_mode"] == "linear"
    assert all(r["measured_kl"] is not None and r["predicted_kl"] == r["measured_kl"] for r in report["rows"])
    # the whole model measured at every uniform scheme: the interaction mapping's points, which it reproduces
    whole = {p["scheme"]: p["measured_kl"] for p in report["interaction"]["fit"]}
    assert set(whole) == {"w2g32", "w3g64", "w4g32", "w8g32"}
    assert whole["w2g32"] > whole["w4g32"] > whole["w8g32"] > 0
    for label, kl in whole.items():
        assert report["uniform"][label]["measured_kl"] == kl
        assert report["uniform"][label]["predicted_kl"] == pytest.approx(kl, rel=1e-9)
    # and mixtures it was not fitted on, measured whole, between the uniform sizes
    checks = report["interaction"]["check"]
    assert checks and all(c["measured_kl"] > 0 and len(c["schemes"]) >= 1 for c in checks)


def test_layered_kl_meter_matches_a_full_forward_through_scoring(tiny_llama_dir):
    from quantkit.allocation.sensitivity import KLMeter
    from quantkit.baseline_cache import in_memory_baseline
    from quantkit.models import get_adapter
    from quantkit.scoring import compare, logits_of
    from quantkit.sources import load_source_model

    model, *_ = load_source_model(str(tiny_llama_dir), dtype=torch.float32)
    windows = torch.randint(0, 49152, (3, 24), generator=torch.Generator().manual_seed(0))
    meter = KLMeter(model, get_adapter(model), windows, batch_size=2)
    baseline = in_memory_baseline(model, windows, batch_size=2)
    lin = model.model.layers[1].mlp.down_proj
    noisy = lin.weight.data + 0.05 * torch.randn_like(lin.weight)
    got = meter.kl_with({"model.layers.1.mlp.down_proj": noisy})
    original = lin.weight.data
    lin.weight.data = noisy
    want = compare(logits_of(model), baseline, windows, batch_size=2)["kl_mean"]
    lin.weight.data = original
    assert want > 1e-5
    assert got == pytest.approx(want, rel=1e-4)


def _unpack_lsb(words: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
    """GPTQ v1 packing read as a little-endian bit stream along `dim` (plain PyTorch, no quantkit)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = w if dim == 0 else w.t()
    stream = ((w.unsqueeze(1) >> torch.arange(32).view(1, 32, 1)) & 1).reshape(-1, w.shape[1])  # [words*32, cols]
    stream = stream[: count * bits].reshape(count, bits, -1)
    values = (stream << torch.arange(bits).view(1, bits, 1)).sum(1)
    return values if dim == 0 else values.t()


def _dequantize_gptq(t: dict, bits: int, out_f: int, in_f: int) -> torch.Tensor:
    codes = _unpack_lsb(t["qweight"], bits, in_f, dim=0)  # [in, out]
    zeros = (_unpack_lsb(t["qzeros"], bits, out_f, dim=1) + 1) & ((1 << bits) - 1)  # [groups, out]
    g = t["g_idx"].long()
    return ((codes - zeros[g]) * t["scales"].float()[g]).t()


@pytest.fixture(scope="module")
def allocated(tmp_path_factory, tiny_llama_dir, report_dir):
    import quantkit

    out = tmp_path_factory.mktemp("alloc") / "mix"
    result = quantkit.quantize(str(tiny_llama_dir), "gptq", group_size=32, num_samples=4, seq_len=32, output=out,
                               target_bits=3.5, sensitivity=report_dir, progress=False)
    return out, result


def test_target_bits_holds_as_counted_from_the_written_files(allocated, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    out, result = allocated
    sizes, _ = _linears(out)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    weights = sum(m.weight.numel() for n, m in model.named_modules() if n in sizes)
    assert len(sizes) == 14
    bits = 8 * sum(sizes.values()) / weights
    assert 3.0 < bits <= 3.5
    assert bits == pytest.approx(result["allocation"]["bits_per_weight"], abs=1e-3)
    assert len(result["allocation"]["schemes"]) > 1  # a mixture, not one scheme


def test_target_size_holds_as_counted_from_the_written_files(tmp_path, tiny_llama_dir, report_dir):
    import quantkit

    report = json.loads((report_dir / "sensitivity.json").read_text())
    lo, hi = report["uniform"]["w2g32"]["packed_bytes"], report["uniform"]["w4g32"]["packed_bytes"]
    target = report["fixed_bytes"] + (lo + hi) // 2
    quantkit.quantize(str(tiny_llama_dir), "gptq", group_size=32, num_samples=4, seq_len=32, output=tmp_path / "m",
                      target_size=str(target), sensitivity=report_dir, progress=False)
    written = sum(p.stat().st_size for p in (tmp_path / "m").glob("*.safetensors"))
    assert target - 8192 < written <= target  # the budget used up to a few linears' worth of the tiny model


def test_gptq_dynamic_rules_give_each_linear_its_allocated_scheme(allocated):
    """GPTQModel's `dynamic` (gptqmodel/quantization/config.py dynamic_get): rules tried in order,
    re.match on the module name, "-:" skips the module, "+:" (or bare) overrides its keys."""
    out, result = allocated
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    _, tensors = _linears(out)

    def rule_for(name):
        for pattern, overrides in qcfg.get("dynamic", {}).items():
            if pattern.startswith("-:"):
                if re.match(pattern[2:], name):
                    return False
            elif re.match(pattern[2:] if pattern.startswith("+:") else pattern, name):
                return overrides
        return {}

    chosen = json.loads((out / "sensitivity.json").read_text())["allocation"]["choice"]
    assert set(chosen) == set(tensors)
    for name, label in chosen.items():
        o = rule_for(name)
        assert o is not False
        bits, group = o.get("bits", qcfg["bits"]), o.get("group_size", qcfg["group_size"])
        assert isinstance(bits, int) and isinstance(group, int)
        assert f"w{bits}g{group}" == label


def test_mixture_loads_and_matches_a_plain_dequantized_reference(allocated, tiny_llama_dir):
    import quantkit
    from transformers import AutoModelForCausalLM

    out, _ = allocated
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    chosen = json.loads((out / "sensitivity.json").read_text())["allocation"]["choice"]
    _, tensors = _linears(out)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).float().eval()
    modules = dict(ref.named_modules())
    for name, t in tensors.items():
        bits = int(re.match(r"w(\d)", chosen[name]).group(1))
        lin = modules[name]
        lin.weight.data = _dequantize_gptq(t, bits, lin.out_features, lin.in_features)
    assert qcfg["quant_method"] == "gptq"
    model = quantkit.load(out, backend="reference", dtype="float32")
    ids = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_card_references_the_pictures(allocated):
    out, _ = allocated
    card = (out / "README.md").read_text()
    for f in ("sensitivity_heatmap.png", "sensitivity_size_kl.png", "sensitivity.json", "sensitivity.html"):
        assert f in card and (out / f).is_file()


def test_budgets_below_the_smallest_scheme_are_refused_with_the_minimum(tmp_path, tiny_llama_dir, report_dir):
    import quantkit

    report = json.loads((report_dir / "sensitivity.json").read_text())
    smallest = report["uniform"]["w2g32"]
    kw = dict(group_size=32, num_samples=4, seq_len=32, sensitivity=report_dir, progress=False)
    with pytest.raises(QuantkitError, match=f"smallest possible.*{smallest['bits_per_weight']:.3f} bits per weight"):
        quantkit.quantize(str(tiny_llama_dir), "gptq", output=tmp_path / "a", target_bits=1.5, **kw)
    with pytest.raises(QuantkitError, match=rf"smallest possible size.*\({report['fixed_bytes'] + smallest['packed_bytes']} bytes"):
        quantkit.quantize(str(tiny_llama_dir), "gptq", output=tmp_path / "b", target_size="1MB", **kw)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("fmt, why", [("awq", "cannot carry a mixture"), ("gguf", "GGUF per-tensor types")])
def test_formats_that_cannot_carry_a_mixture_are_refused(tmp_path, tiny_llama_dir, report_dir, fmt, why):
    import quantkit

    with pytest.raises(QuantkitError, match=why):
        quantkit.quantize(str(tiny_llama_dir), "gptq", format=fmt, group_size=32, num_samples=4, seq_len=32,
                          output=tmp_path / "x", target_bits=4, sensitivity=report_dir, progress=False)


def test_compressed_tensors_mixture_matches_its_own_decompressor(tmp_path, tiny_llama_dir, report_dir):
    """The same report allocates a compressed-tensors run (bytes re-counted for that layout); the
    mixture is one config group per scheme, which transformers + compressed-tensors decompress."""
    pytest.importorskip("compressed_tensors")
    import quantkit
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ct"
    result = quantkit.quantize(str(tiny_llama_dir), "gptq", format="compressed-tensors", group_size=32, num_samples=4,
                               seq_len=32, output=out, target_bits=4.5, sensitivity=report_dir, progress=False)
    assert len(result["allocation"]["schemes"]) > 1
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert len(groups) == len(result["allocation"]["schemes"])
    ids = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(2))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = quantkit.load(out, backend="reference", dtype="float32")
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, hf(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_cli_refuses_a_budget_below_the_minimum_in_one_line(tmp_path, tiny_llama_dir, report_dir, capsys):
    from quantkit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", "--model", str(tiny_llama_dir), "--method", "gptq", "--group-size", "32", "--num-samples", "4",
              "--seq-len", "32", "--target-bits", "1", "--sensitivity", str(report_dir), "--output", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "smallest possible" in err and "bits per weight" in err


def test_sensitivity_cli_writes_the_report(tmp_path, tiny_llama_dir, capsys):
    from quantkit.cli import main

    out = tmp_path / "r"
    with pytest.raises(SystemExit) as exit_info:
        main(["sensitivity", "--model", str(tiny_llama_dir), "--group-size", "32", "--candidate-bits", "2,4",
              "--num-samples", "2", "--seq-len", "16", "--eval-windows", "1", "--eval-seq-len", "16", "--sample", "1",
              "--no-measure-layers", "--no-measure-linears", "--output", str(out), "--json"])
    assert exit_info.value.code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rows"] == 14 * 2 and summary["calibration_mode"] == "scheme"
    assert {p.name for p in out.iterdir()} == {"sensitivity.json", "sensitivity_heatmap.png", "sensitivity_size_kl.png",
                                               "sensitivity.html"}


def test_target_size_parsing():
    from quantkit.allocation.budget import parse_size

    assert parse_size("2.1GB") == 2_100_000_000
    assert parse_size("700MiB") == 700 * 2**20
    assert parse_size("123456") == 123456
    with pytest.raises(QuantkitError, match="not a size"):
        parse_size("2.1 gigs")


def test_target_bits_without_a_report_measures_one_first(tmp_path, tiny_llama_dir, monkeypatch):
    import quantkit
    from quantkit.allocation import run

    measure = run.sensitivity_of_model  # the real one, on fewer evaluation tokens than its defaults
    monkeypatch.setattr(run, "sensitivity_of_model",
                        lambda *a, **kw: measure(*a, **{**kw, "eval_windows": 2, "eval_seq_len": 32, "sample": 2}))
    out = tmp_path / "m"
    result = quantkit.quantize(str(tiny_llama_dir), "gptq", group_size=32, num_samples=4, seq_len=32, output=out,
                               target_bits=4.0, progress=False)
    assert result["allocation"]["bits_per_weight"] <= 4.0
    report = json.loads((out / "sensitivity.json").read_text())
    assert report["calibration"]["num_samples"] == 4 and report["calibration_mode"] == "linear"


def test_interaction_mapping_passes_through_its_points_and_is_monotone():
    from quantkit.allocation import interaction

    points = [(0.01, 0.05), (0.1, 0.2), (1.0, 4.0)]
    mapping = interaction.fit(points)
    for total, whole in points:
        assert interaction.predict(total, mapping) == pytest.approx(whole, rel=1e-12)
    # between two points: the straight line in log-log (geometric interpolation)
    assert interaction.predict(0.1 ** 0.5 * 0.01 ** 0.5, mapping) == pytest.approx((0.05 * 0.2) ** 0.5, rel=1e-12)
    grid = [10 ** (k / 10) for k in range(-40, 11)]
    values = [interaction.predict(x, mapping) for x in grid]
    assert all(a <= b for a, b in zip(values, values[1:]))
    # a point that would make it decrease is lifted; one point is a plain ratio; none: the sum itself
    assert interaction.predict(0.5, interaction.fit([(0.1, 0.3), (1.0, 0.2)])) >= 0.3
    assert interaction.predict(2.0, interaction.fit([(1.0, 3.0)])) == pytest.approx(6.0)
    assert interaction.predict(2.0, None) == 2.0


def test_candidate_labels_parse_onto_the_linears_scheme():
    from quantkit.allocation.sensitivity import candidates_for
    from quantkit.scheme import LinearScheme

    base = LinearScheme(bits=4, group_size=64, sym=True)
    got = candidates_for(base, (3, "w4g128", "w8pc", "w2g32a", 4, "w4g64"))
    assert got == (LinearScheme(3, 64, True), LinearScheme(4, 128, True), LinearScheme(8, -1, True),
                   LinearScheme(2, 32, False), LinearScheme(4, 64, True))
    with pytest.raises(QuantkitError, match="w4g128"):
        candidates_for(base, ("4bit",))
    with pytest.raises(QuantkitError, match="unsupported group size 16"):
        candidates_for(base, ("w4g16",))


def test_anchored_measurement_predicts_other_schemes_from_each_linears_own_ratio(tmp_path, tiny_llama_dir):
    """--measure-at w4g32: every linear measured at w4g32 only; its other schemes predicted as proxy x
    its own measured KL per unit of proxy; the sampled linears measured at every scheme (the check)."""
    import quantkit.api as api

    out = tmp_path / "anchored"
    api.sensitivity(str(tiny_llama_dir), "gptq", group_size=32, num_samples=4, seq_len=32, eval_windows=2,
                    eval_seq_len=32, candidate_bits=(2, 4, 8), measure_at=(4,), sample=2, output=out, progress=False)
    report = json.loads((out / "sensitivity.json").read_text())
    assert report["calibration_mode"] == "linear"
    rows = {(r["linear"], r["scheme"]): r for r in report["rows"]}
    linears = {n for n, _ in rows}
    assert all(rows[(n, "w4g32")]["measured_kl"] is not None for n in linears)
    for n in [n for n in linears if rows[(n, "w4g32")]["measured_kl"] > 0]:  # else the median ratio
        ratio = rows[(n, "w4g32")]["measured_kl"] / rows[(n, "w4g32")]["proxy"]
        for label in ("w2g32", "w8g32"):
            assert rows[(n, label)]["predicted_kl"] == pytest.approx(rows[(n, label)]["proxy"] * ratio, rel=1e-9)
    sampled = {n for (n, label), r in rows.items() if label != "w4g32" and r["measured_kl"] is not None}
    assert len(sampled) == 2
    assert report["proxy_check"]["modules_x_schemes"] == 2 * 2 and report["proxy_check"]["in_sample"] is False


def test_held_out_windows_are_spread_over_the_second_half_of_each_text(monkeypatch):
    """The sensitivity's KL windows: `count` non-overlapping windows spread evenly over the second half of each
    text (none in the first half, which scorers read from the start), so a long text is sampled across its
    length; a text with fewer windows than asked gives what it has. Token i of a text is i here, so each window
    says where it came from."""
    from quantkit import data
    from quantkit.allocation.run import held_out_windows

    lengths = {"long": 100_000, "short": 700}
    monkeypatch.setattr(data, "eval_token_stream", lambda name, tokenizer: torch.arange(lengths[name]))
    w = held_out_windows("long,short", None, 256, 4)
    long, short = w[:4], w[4:]
    for window in w:
        assert torch.equal(window, torch.arange(int(window[0]), int(window[0]) + 256))  # contiguous text
    starts = long[:, 0].tolist()
    assert all(s >= 50_000 for s in starts) and starts[-1] + 256 <= 100_000
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert min(gaps) >= 256 and max(gaps) - min(gaps) <= 256  # non-overlapping, evenly spread
    assert starts[-1] - starts[0] >= 0.6 * 50_000  # across the half, not bunched at its end
    # 700 tokens: its second half holds one window of 256, but two fit in the text: the last two windows' worth
    assert short.shape[0] == 2 and short[-1, -1] == 699 and short[0, 0] == 700 - 512
