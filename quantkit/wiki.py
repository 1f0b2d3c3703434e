"""The offline ``wiki`` corpus: English Wikipedia articles from a MediaWiki XML export, as plain text.

The export (bz2-compressed XML, see ``assets.wiki_corpus_path``) is read with the standard library's
streaming parser; redirects and pages outside the article namespace are skipped. Markup is removed
by ``mwparserfromhell`` (a maintained wikitext parser; no hand-written regexes over templates):
templates, comments, references, tables, galleries and file/image/category links go entirely, as
do sections that hold no prose (References, External links, See also, ...); links keep their
visible text.

One document is one article. Articles are assigned to the calibration or the held-out (``eval``)
split by a hash of their title, so the assignment is stable and no held-out text shares an
article with calibration text. The cleaned corpus is cached as JSONL in the quantkit cache, keyed
by the export's content and ``CLEANER_VERSION``, so the parse (seconds) happens once.
"""
from __future__ import annotations

import bz2
import hashlib
import json
import re
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Iterator

from quantkit.assets import ENV_WIKI_CORPUS, cache_dir, wiki_corpus_path, write_file_atomically
from quantkit.errors import QuantkitError

CLEANER_VERSION = 1  # bump when the cleaning changes: the cached JSONL is keyed by it
MIN_WORDS = 100  # articles shorter than this after cleaning (stubs, disambiguation lists) are dropped
EVAL_SHARE_PERCENT = 50  # titles whose hash bucket (0-99) is below this are held out

NO_PROSE_SECTIONS = frozenset({
    "references", "external links", "see also", "further reading", "notes", "bibliography",
    "sources", "footnotes", "citations", "works cited", "notes and references",
})
INVISIBLE_TAGS = frozenset({"ref", "references", "table", "gallery", "math", "timeline", "imagemap"})
NON_TEXT_LINK = re.compile(r"\s*:?\s*(file|image|category)\s*:", re.IGNORECASE)  # a link's *title* only
LEFTOVER_MARKUP = ("[[", "]]", "{{", "}}", "<ref", "</ref", "<!--", "-->", "{|", "|}")
MAX_PASSES = 3


@dataclass(frozen=True)
class Article:
    title: str
    text: str
    split: str  # "calibration" or "eval"


# ----------------------------------------------------------------------------- XML export


def _local(tag: str) -> str:
    """``{http://www.mediawiki.org/xml/export-0.10/}page`` -> ``page``: any export schema version."""
    return tag.rsplit("}", 1)[-1]


def iter_pages(stream: IO[bytes]) -> Iterator[tuple[str, str]]:
    """(title, wikitext) of each article page in a MediaWiki XML export, skipping redirects and
    pages outside namespace 0 (talk, project, template, ... pages). Streams: one page in memory."""
    for _, elem in ET.iterparse(stream, events=("end",)):
        if _local(elem.tag) != "page":
            continue
        fields = {_local(child.tag): child.text or "" for child in elem.iter()}
        if fields.get("ns", "").strip() == "0" and "redirect" not in fields and "text" in fields:
            yield fields.get("title", "").strip(), fields["text"]
        elem.clear()


# ----------------------------------------------------------------------------- wikitext


def _is_invisible(node) -> bool:
    """Nodes that render no prose: templates, comments, references, tables, file/category links."""
    from mwparserfromhell.nodes import Comment, Tag, Template, Wikilink

    if isinstance(node, (Template, Comment)):
        return True
    if isinstance(node, Tag):
        return str(node.tag).strip().lower() in INVISIBLE_TAGS
    return isinstance(node, Wikilink) and bool(NON_TEXT_LINK.match(str(node.title)))


def _visible_parts(node) -> list:
    """The nested wikicode of ``node`` that ``strip_code`` renders (a link's text, a tag's contents)."""
    from mwparserfromhell.nodes import ExternalLink, Heading, Tag, Wikilink

    if isinstance(node, Tag):
        return [node.contents] if node.contents else []
    if isinstance(node, Wikilink):
        return [node.text] if node.text is not None else []
    if isinstance(node, (Heading, ExternalLink)):
        return [node.title] if node.title else []
    return []


class _SectionFilter:
    """Walked in document order: inside a section listed in NO_PROSE_SECTIONS (subsections included)
    until the next heading of the same or a higher level."""

    def __init__(self):
        self.skip_level: int | None = None

    def keeps(self, node) -> bool:
        from mwparserfromhell.nodes import Heading

        if isinstance(node, Heading):
            if self.skip_level is not None and node.level <= self.skip_level:
                self.skip_level = None
            if self.skip_level is None and node.title.strip_code().strip().lower() in NO_PROSE_SECTIONS:
                self.skip_level = node.level
        return self.skip_level is None


def _prune(code, sections: _SectionFilter) -> None:
    """Remove invisible nodes and no-prose sections at every depth in one walk.

    Tags are entered even inside a skipped section: an italic run the parser left open (``''x``)
    nests the rest of the article, headings included, inside one tag, so a section can start
    inside a tag and end outside it. One walk, because ``Wikicode.remove`` searches the whole
    tree per call (quadratic on a long article).
    """
    from mwparserfromhell.nodes import Tag

    kept = []
    for node in code.nodes:
        if _is_invisible(node):
            continue
        if isinstance(node, Tag) or sections.keeps(node):
            for part in _visible_parts(node):
                _prune(part, sections)
            kept.append(node)
    code.nodes = kept


def _strip_once(wikitext: str) -> str:
    import mwparserfromhell

    code = mwparserfromhell.parse(wikitext)
    _prune(code, _SectionFilter())
    return code.strip_code(collapse=False)  # collapse=True trims newlines around nested tags; _tidy collapses


def _tidy(text: str) -> str:
    """Per paragraph: drop any the parser could not make sense of (markup left in it), strip the
    lines, remove bold/italic quote runs the parser left unpaired (``''Iliad'''s`` -> ``Iliad's``)."""
    paragraphs = []
    for para in re.split(r"\n\s*\n", text):
        if any(mark in para for mark in LEFTOVER_MARKUP):
            continue
        para = re.sub(r"'{2,}", "", re.sub(r"(?<=\w)'{2,}(?=\w)", "'", para))
        lines = [line.strip() for line in para.split("\n")]
        para = "\n".join(line for line in lines if line)
        if para:
            paragraphs.append(para)
    return "\n\n".join(paragraphs)


def clean_wikitext(wikitext: str) -> str:
    """Plain prose of one article's wikitext: paragraphs separated by one blank line.

    ``mwparserfromhell`` keeps a construct it cannot parse (a reference with an italic opened
    inside, a table with a broken attribute) as text, and with it everything nested inside;
    parsing the stripped text again recovers most (up to ``MAX_PASSES``). A paragraph still
    holding markup after that is dropped.
    """
    text = wikitext
    for _ in range(MAX_PASSES):
        text = _strip_once(text)
        if not any(mark in text for mark in LEFTOVER_MARKUP):
            break
    return _tidy(text)


# ----------------------------------------------------------------------------- corpus


def split_of(title: str) -> str:
    """``eval`` or ``calibration``, from a hash of the title: stable across runs, machines and exports."""
    bucket = int.from_bytes(hashlib.sha256(title.encode("utf-8")).digest()[:8], "big") % 100
    return "eval" if bucket < EVAL_SHARE_PERCENT else "calibration"


def parse_export(path: Path, min_words: int = MIN_WORDS) -> list[Article]:
    """Every article of a bz2 MediaWiki export with at least ``min_words`` words left after
    cleaning, in export order."""
    articles = []
    try:
        with bz2.open(path, "rb") as stream:
            for title, wikitext in iter_pages(stream):
                text = clean_wikitext(wikitext)
                if len(text.split()) >= min_words:
                    articles.append(Article(title, text, split_of(title)))
    except (OSError, EOFError, ET.ParseError) as e:  # bz2 raises OSError / EOFError on corrupt data
        raise QuantkitError(
            f"could not read the Wikipedia export {path} ({type(e).__name__}: {e}); it is corrupt or "
            f"truncated: delete it to fetch it again, or point {ENV_WIKI_CORPUS} at a good copy"
        ) from None
    if not articles:
        raise QuantkitError(
            f"the Wikipedia export {path} holds no articles; point {ENV_WIKI_CORPUS} at a MediaWiki XML export"
        )
    return articles


def _cache_path(export: Path) -> Path:
    digest = hashlib.sha256()
    with open(export, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return cache_dir() / "wiki" / f"articles-{digest.hexdigest()[:16]}-v{CLEANER_VERSION}.jsonl"


def wiki_articles(export: Path | None = None) -> list[Article]:
    """The cleaned ``wiki`` corpus: parsed from the export once, then read from the JSONL cache."""
    export = export or wiki_corpus_path()
    cached = _cache_path(export)
    if not cached.is_file():
        articles = parse_export(export)
        lines = "".join(json.dumps(asdict(a), ensure_ascii=False) + "\n" for a in articles)
        write_file_atomically(cached, lambda out: out.write(lines.encode("utf-8")))
        return articles
    with open(cached, encoding="utf-8") as f:
        return [Article(**json.loads(line)) for line in f]
