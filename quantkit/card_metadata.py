"""The model card's Hub metadata: the YAML front matter that the Hub (and `huggingface_hub.ModelCard`) reads.

What it states is what quantkit knows, never a guess: `base_model` only when the source is a hub id
(a local folder or file has no hub page to link to), `license` and `language` carried from the
source model where it states them (a GGUF file's `general.license` / `general.languages`, a local
folder's README front matter, a hub model's README already in the local Hugging Face cache: no
network), `datasets` for the calibration data when it is a named dataset, and `model-index` with
the measured figures once `quantize --eval` has scored the checkpoint.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

# a hub repo id "owner/name", never a local path. A bare name is not taken for one: an in-memory
# model without a name_or_path is named by its model_type ("llama"), and the Hub's few legacy
# unowned repos (gpt2) now live under an owner too
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class SourceFacts:
    """What the card may say of the model a checkpoint was quantized from."""

    hub_id: Optional[str] = None  # set only when the source is a hub model
    license: Optional[str] = None
    license_name: Optional[str] = None  # with license "other"
    license_link: Optional[str] = None
    language: Optional[list[str]] = None


def is_hub_id(name: str) -> bool:
    """True for an "owner/name" hub repo id that is not also a local path (a folder named like an id is local)."""
    return bool(_HUB_ID.match(name)) and not Path(name).exists() and not name.endswith(".gguf")


def source_facts(name: str) -> SourceFacts:
    """The facts about the source named `name` (a folder, a .gguf file, a hub id, or the demo's hub id)."""
    path = Path(name)
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    if path.is_dir():
        return _from_front_matter(path / "README.md")
    if not is_hub_id(name):
        return SourceFacts()  # e.g. an in-memory model's description
    from quantkit.assets import DEMO_BASE_MODEL

    cached = _cached_hub_readme(name)
    facts = _from_front_matter(cached) if cached is not None else SourceFacts()
    if name == DEMO_BASE_MODEL and facts.license is None:
        facts = _demo_facts()
    return SourceFacts(name, facts.license, facts.license_name, facts.license_link, facts.language)


def _from_gguf(path: Path) -> SourceFacts:
    from quantkit.formats.gguf.container import read_gguf

    try:
        f = read_gguf(path)
    except Exception:  # noqa: BLE001 - the card says less rather than fail a finished run
        return SourceFacts()
    meta = f.metadata
    f.close()
    lic = meta.get("general.license")
    langs = meta.get("general.languages")
    return SourceFacts(license=lic if isinstance(lic, str) and lic else None,
                       language=[str(x) for x in langs] if isinstance(langs, list) and langs else None)


def _demo_facts() -> SourceFacts:
    """The demo's license and language, from its GGUF file's metadata when it is already fetched."""
    from quantkit.assets import DEMO_DIR_NAME, cache_dir, demo_gguf_path

    if not (cache_dir() / DEMO_DIR_NAME).is_dir():
        return SourceFacts()  # not fetched: the card does not start a download
    try:
        return _from_gguf(demo_gguf_path())
    except Exception:  # noqa: BLE001
        return SourceFacts()


def _cached_hub_readme(repo_id: str) -> Optional[Path]:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "README.md")
    except Exception:  # noqa: BLE001 - no hub library or an odd cache: nothing known
        return None
    return Path(found) if isinstance(found, str) else None


def read_front_matter(text: str) -> tuple[dict[str, Any], str]:
    """(metadata, body) of a model card; ({}, text) when it has no parseable YAML front matter."""
    m = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, flags=re.S)
    if not m:
        return {}, text
    try:
        data = yaml.safe_load(m.group(1))
    except yaml.YAMLError:
        return {}, text
    return (data if isinstance(data, dict) else {}), text[m.end():]


def _from_front_matter(readme: Path) -> SourceFacts:
    try:
        data, _ = read_front_matter(readme.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return SourceFacts()
    lic = data.get("license")
    lang = data.get("language")
    if isinstance(lang, str):
        lang = [lang]
    text = lambda v: v if isinstance(v, str) and v else None  # noqa: E731
    return SourceFacts(license=text(lic), license_name=text(data.get("license_name")),
                       license_link=text(data.get("license_link")),
                       language=[str(x) for x in lang] if isinstance(lang, list) and lang else None)


def calibration_datasets(calibration: Optional[str]) -> Optional[list[str]]:
    """The card's `datasets`: the hub id of a named hub dataset, the name of a bundled offline corpus;
    None for a file or in-memory data (the card's body describes those) or a method that reads none."""
    if not calibration:
        return None
    from quantkit.data import registry

    spec = registry().get(calibration)
    if spec is None:
        return None
    if spec.path:
        return [spec.path]
    return [OFFLINE_CORPORA.get(calibration, calibration)]


OFFLINE_CORPORA = {  # the bundled corpora by the names of the files gensim's wheel ships them as
    "lee": "gensim lee_background corpus",
    "wiki": "gensim enwiki-latest-pages-articles1 sample",
}


def front_matter(source: str, tags: list[str], calibration: Optional[str], library: str = "transformers",
                 repacked: bool = False) -> dict[str, Any]:
    """The card's metadata at write time (model-index is added by `with_model_index` after --eval).

    `library` is the Hub library that loads the files ("gguf" for a GGUF file: the Hub lists those under
    library=gguf). `repacked`: the source is itself a quantized checkpoint re-packed without changing a
    weight (`quantkit convert`), so its own card's `base_model` is still the model these weights came from."""
    facts = source_facts(source)
    data: dict[str, Any] = {}
    base = facts.hub_id or (repacked_base(source) if repacked else None)
    if base:
        data.update(base_model=base, base_model_relation="quantized")
    if facts.license:
        data["license"] = facts.license
        data.update({k: v for k, v in (("license_name", facts.license_name), ("license_link", facts.license_link)) if v})
    if facts.language:
        data["language"] = facts.language
    datasets = calibration_datasets(calibration)
    if datasets:
        data["datasets"] = datasets
    data.update(library_name=library, pipeline_tag="text-generation", tags=list(dict.fromkeys(tags)))
    return data


def repacked_base(folder: str) -> Optional[str]:
    """The hub id a quantized checkpoint folder's own card names as its `base_model` (quantkit writes it only
    for a hub source), or None. Only for a re-pack: a model *trained* from a base is not a quantization of it."""
    try:
        data, _ = read_front_matter((Path(folder) / "README.md").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return None
    base = data.get("base_model")
    return base if isinstance(base, str) and _HUB_ID.match(base) and data.get("base_model_relation") == "quantized" else None


def render_front_matter(data: dict[str, Any]) -> str:
    return "---\n" + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1000) + "---\n"


def with_model_index(card: str, model_name: str, dataset: str, metrics: list[tuple[str, str, float]]) -> str:
    """The card with `model-index` (the Hub's evaluation results) set to `metrics`, a list of
    (metric type, metric name, value) measured on the held-out split of `dataset`."""
    data, body = read_front_matter(card)
    ids = calibration_datasets(dataset)
    data["model-index"] = [{
        "name": model_name,
        "results": [{
            "task": {"type": "text-generation", "name": "Text Generation"},
            "dataset": {"name": f"{dataset} (held-out split)", "type": ids[0] if ids else str(dataset),
                        "split": "held-out"},
            "metrics": [{"type": t, "name": n, "value": v} for t, n, v in metrics],
        }],
    }]
    return render_front_matter(data) + body


def eval_model_index(dataset, report: dict[str, Any], against_original: bool) -> dict[str, Any]:
    """`append_card_metrics`' model_index from an `evaluate` report: held-out perplexity, and against
    the original model its mean and 99th-percentile KL divergence per token and top-1 agreement."""
    metrics = [("perplexity", "held-out perplexity", round(float(report["perplexity"]), 4))]
    if against_original:
        metrics += [("kl_divergence", "KL divergence to the original (mean per token)", round(float(report["kl_mean"]), 5)),
                    ("kl_divergence_p99", "KL divergence to the original (99th percentile)",
                     round(float(report["kl_p99"]), 5)),
                    ("top1_agreement", "top-1 agreement with the original", round(float(report["top1_agreement"]), 5))]
    name = Path(dataset).name if isinstance(dataset, Path) else str(dataset)
    return {"dataset": name, "metrics": metrics}
