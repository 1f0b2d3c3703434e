"""quantkit.wiki and ``--dataset wiki``: MediaWiki export -> clean article text, split by article.

Fast tests parse hand-written exports (the expected text is written out by hand, not produced by
the code under test) and run ``quantize``/``eval --dataset wiki`` on one. The slow test uses the real export from the gensim wheel (pip, cached) and
the demo tokenizer.
"""
import bz2
import json
from xml.sax.saxutils import escape

import pytest
from conftest import last_json, run_cli

from quantkit import data, wiki
from quantkit.errors import QuantkitError

MARKUP = ("[[", "]]", "{{", "}}", "<ref", "{|", "|}", "<!--", "'''")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("QUANTKIT_WIKI_CORPUS", raising=False)


def page(title, ns, wikitext, redirect=None):
    red = f'<redirect title="{escape(redirect)}" />' if redirect else ""
    return (f"<page><title>{escape(title)}</title><ns>{ns}</ns><id>1</id>{red}<revision><id>2</id>"
            f'<text xml:space="preserve">{escape(wikitext)}</text></revision></page>')


def export(path, *pages):
    """A bz2 MediaWiki export (namespaced, like real dumps) holding ``pages``."""
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" xml:lang="en">'
           "<siteinfo><sitename>Wikipedia</sitename></siteinfo>" + "".join(pages) + "</mediawiki>")
    path.write_bytes(bz2.compress(xml.encode("utf-8")))
    return path


AARDVARK = """{{Infobox animal|name=Aardvark|image=Aardvark.jpg}}
The '''aardvark''' (''Orycteropus afer'') is a [[mammal]] native to [[Africa|the African continent]].<ref>{{cite book|title=Mammals|year=1999}}</ref> It is nocturnal.<ref name="x"/><!-- hidden note -->
[[File:Aardvark.jpg|thumb|An [[aardvark]] at night]]

{| class="wikitable"
|-
! Name !! Mass
|-
| Aardvark || 60 kg
|}

== Diet ==
It eats [[ant]]s and termites{{citation needed|date=May 2016}}. The ''Iliad'''s aardvark is a joke.

=== Habitat ===
Savannas and [http://example.org grasslands].

== See also ==
* [[Anteater]]

=== Related ===
* [[Pangolin]]

== References ==
{{Reflist}}
* Smith, J. ''Aardvarks''. 2001.

== External links ==
* [http://example.org Aardvark site]

[[Category:Mammals]]
[[Image:Second.png|left]]
"""
AARDVARK_TEXT = (
    "The aardvark (Orycteropus afer) is a mammal native to the African continent. It is nocturnal.\n"
    "\n"
    "Diet\n"
    "It eats ants and termites. The Iliad's aardvark is a joke.\n"
    "\n"
    "Habitat\n"
    "Savannas and grasslands."
)


def test_export_to_clean_articles(tmp_path):
    path = export(
        tmp_path / "dump.xml.bz2",
        page("Redirected", 0, "#REDIRECT [[Aardvark]]", redirect="Aardvark"),
        page("Wikipedia:Sandbox", 4, "Project page prose that must not appear."),
        page("Aardvark", 0, AARDVARK),
        page("Talk:Aardvark", 1, "Talk page prose that must not appear."),
    )
    articles = wiki.parse_export(path, min_words=1)
    assert [(a.title, a.text) for a in articles] == [("Aardvark", AARDVARK_TEXT)]
    assert articles[0].split in ("calibration", "eval")
    words = len(AARDVARK_TEXT.split())  # 31: shorter articles than min_words are dropped as stubs
    assert len(wiki.parse_export(path, min_words=words)) == 1
    with pytest.raises(QuantkitError, match="holds no articles"):
        wiki.parse_export(path, min_words=words + 1)


def test_unparsed_markup_is_retried_then_dropped():
    import mwparserfromhell

    # An italic opened inside a ref and a later '' make the parser keep the ref as text: one
    # strip_code leaves it, stripping the result again removes it.
    wikitext = "Said.<ref>In ''[[Big Book]], by X.</ref><ref>Y.</ref> Then.\n\nNext ''[[e]]''."
    assert "<ref>" in mwparserfromhell.parse(wikitext).strip_code()
    assert wiki.clean_wikitext(wikitext) == "Said. Then.\n\nNext e."
    # A table with a broken attribute never parses: its paragraph is dropped, the rest kept.
    text = wiki.clean_wikitext('Before.\n\n{| class="x" y:1;"\n|-\n| cell\n|}\n\nAfter the table.')
    assert text == "Before.\n\nAfter the table."


def test_sections_that_cross_an_unclosed_italic_are_still_dropped():
    import mwparserfromhell

    # '' left open: the parser nests what follows, headings included, inside one italic tag, so a
    # no-prose section can start inside the tag and end outside it, or the other way round.
    ends_outside = "Lead ''open [[x]] and.\n== History ==\nProse.\n\n== References ==\n* Book ''one'' here\n" \
                   "* Book two\n\n== Later ==\nMore prose.\n"
    starts_outside = "Lead.\n\n== See also ==\n* ''Open [[x]] and\n\n== History ==\nProse ''a''.\n\n== Notes ==\n* Note\n"
    for wikitext, nested in ((ends_outside, "References"), (starts_outside, "History")):
        code = mwparserfromhell.parse(wikitext)
        heading = next(h for h in code.filter_headings() if nested in str(h.title))
        assert code.get_ancestors(heading), "the parser no longer nests this heading: the test needs a new case"
    assert wiki.clean_wikitext(ends_outside) == "Lead open x and.\nHistory\nProse.\n\nLater\nMore prose."
    assert wiki.clean_wikitext(starts_outside) == "Lead.\n\nHistory\nProse a."


@pytest.mark.parametrize("body", [
    None,  # filled in below: the first half of a good export
    b"this is not bzip2 data at all",
    bz2.compress(b"<mediawiki><page><title>x</page></mediawiki>"),
    bz2.compress(b"<mediawiki></mediawiki>"),
], ids=["truncated", "not-bz2", "malformed-xml", "no-articles"])
def test_bad_export_is_a_one_line_error(tmp_path, monkeypatch, body):
    path = tmp_path / "dump.xml.bz2"
    if body is None:
        whole = export(tmp_path / "whole.xml.bz2", page("Aardvark", 0, AARDVARK)).read_bytes()
        body = whole[: len(whole) // 2]
    path.write_bytes(body)
    with pytest.raises(QuantkitError) as err:
        wiki.parse_export(path)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "QUANTKIT_WIKI_CORPUS" in msg, msg
    monkeypatch.setenv("QUANTKIT_WIKI_CORPUS", str(path))  # the same through --dataset wiki
    with pytest.raises(QuantkitError, match="QUANTKIT_WIKI_CORPUS"):
        data.load_texts("wiki", "calibration")


def test_cleaned_corpus_is_cached(tmp_path, monkeypatch):
    long_prose = " ".join(f"word{i}" for i in range(120)) + "."
    path = export(tmp_path / "dump.xml.bz2", page("Aardvark", 0, long_prose + "\n" + AARDVARK))
    monkeypatch.setenv("QUANTKIT_WIKI_CORPUS", str(path))
    first = wiki.wiki_articles()
    assert [a.title for a in first] == ["Aardvark"] and first[0].text.startswith(long_prose)
    cached = list((tmp_path / "cache" / "wiki").iterdir())
    assert len(cached) == 1 and json.loads(cached[0].read_text()) == {
        "title": "Aardvark", "text": first[0].text, "split": first[0].split}
    monkeypatch.setattr(wiki, "parse_export", lambda *a, **k: pytest.fail("parsed again"))
    assert wiki.wiki_articles() == first
    export(path, page("Aardvark", 0, long_prose + " More.\n" + AARDVARK))  # another export: its own cache entry
    with pytest.raises(pytest.fail.Exception, match="parsed again"):
        wiki.wiki_articles()


def test_split_is_by_title_and_stable():
    titles = [f"Article {i}" for i in range(400)]
    splits = [wiki.split_of(t) for t in titles]
    assert splits == [wiki.split_of(t) for t in titles]
    assert set(splits) == {"calibration", "eval"}
    assert 0.4 < splits.count("eval") / len(splits) < 0.6  # EVAL_SHARE_PERCENT = 50 buckets of 100


@pytest.mark.slow  # two CLI runs in subprocesses, ~16 CPU s
def test_cli_quantize_and_eval_on_wiki(tmp_path, tiny_llama_dir):
    """``--dataset wiki`` through both commands, on a hand-written export (offline, seconds)."""
    prose = " ".join(f"Sentence {i} says that the river {i} runs past the old mill." for i in range(25))
    titles = [f"Article {i}" for i in range(8)]
    assert {wiki.split_of(t) for t in titles} == {"calibration", "eval"}  # both splits get articles
    env = {"QUANTKIT_WIKI_CORPUS": str(export(tmp_path / "dump.xml.bz2", *(page(t, 0, prose) for t in titles)))}
    out = tmp_path / "q"
    proc = run_cli("quantize", "--model", tiny_llama_dir, "--method", "gptq", "--group-size", "32", "--dataset",
                   "wiki", "--num-samples", "4", "--seq-len", "64", "--output", out, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("eval", "--model", out, "--dataset", "wiki", "--seq-len", "64", "--max-windows", "2", "--json",
                   env=env)
    assert proc.returncode == 0, proc.stderr
    assert last_json(proc.stdout)["windows"] == 2


@pytest.mark.slow
def test_wiki_dataset_with_demo_tokenizer(monkeypatch):
    """The real export (gensim wheel) and SmolLM2 tokenizer: clean text, disjoint splits, sizes."""
    from transformers import AutoTokenizer

    from quantkit import assets

    monkeypatch.delenv("QUANTKIT_CACHE")  # the real cache: fetched and parsed once
    articles = wiki.wiki_articles()
    cal, ev, every = (data.load_texts("wiki", s) for s in ("calibration", "eval", "all"))
    assert len(cal) > 40 and len(ev) > 40 and sorted(every) == sorted(cal + ev)
    titles = {s: {a.title for a in articles if a.split == s} for s in ("calibration", "eval")}
    assert not titles["calibration"] & titles["eval"] and not set(cal) & set(ev)
    assert len({a.title for a in articles}) == len(articles)
    for text in every:
        assert not [m for m in MARKUP if m in text]
        assert not {"References", "External links", "See also", "Further reading"} & set(text.split("\n"))
    anarchism = next(a.text for a in articles if a.title == "Anarchism")
    assert anarchism.startswith("Anarchism is a political philosophy that advocates self-governed societies "
                                "based on voluntary institutions.")

    tok = AutoTokenizer.from_pretrained(assets.demo_model_dir())
    stream = data.eval_token_stream("wiki", tok)
    assert len(stream) > 200_000
    assert data.calibration_batches("wiki", tok, num_samples=512, seq_len=512).shape == (512, 512)
    n_cal = sum(len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in cal)
    print(f"\nwiki (SmolLM2): calibration {len(cal)} articles, {n_cal} tokens; "
          f"eval {len(ev)} articles, {len(stream)} tokens")
