"""Raw MediaWiki XML dumps (`*pages-articles*.xml.bz2`, or plain `.xml`) -> plain-text articles.

Pages are streamed with `iterparse` and dropped as soon as they are read, so memory does not grow
with the dump. The wikitext's conversion to plain text is `data.wikitext.wikitext_to_text`.
"""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from pathlib import Path

from data.config import SourceConfig
from data.documents import DataError, Document, SkipCounter
from data.sources.files import STREAM_ERRORS, one_line, open_binary, resolve_paths
from data.wikitext import wikitext_to_text

__all__ = ["DUMP_PATTERNS", "read_wiki_dump", "wikitext_to_text"]

DUMP_PATTERNS = ("*.xml", "*.xml.bz2", "*.xml.gz", "*.xml-*.bz2")  # multi-part: *.xml-p1p41242.bz2


def read_wiki_dump(cfg: SourceConfig, skips: SkipCounter, *, convert: bool = True) -> Iterator[Document]:
    """Articles of the dump file(s) at `cfg.path` (a file, a folder of `*.xml[.bz2|.gz]`, or a glob).

    Yields one Document per main-namespace, non-redirect page whose text is not empty after
    cleaning; counts skipped pages as "redirect", "namespace" (non-zero namespace) and "empty".
    Raises DataError (one line, naming the file and the page/line reached) on a truncated or
    corrupt compressed stream or malformed XML. `convert=False` yields the raw wikitext
    (`markup="wikitext"`, converted later by `Document.plain_text()`, which returns "" for a page
    this reader would have counted as "empty").
    """
    assert cfg.path is not None, "SourceConfig requires a path for local sources"
    for path in resolve_paths(cfg.path, DUMP_PATTERNS, "MediaWiki XML dump"):
        yield from _read_dump_file(path, skips, convert)


def _local_name(tag: str) -> str:
    """`{http://www.mediawiki.org/xml/export-0.10/}page` -> `page`: any export schema version."""
    return tag.rpartition("}")[2]


def _page_fields(page: ElementTree.Element) -> tuple[str, str, bool, str]:
    """(title, namespace, is_redirect, wikitext) of a `<page>`; the last revision's text."""
    title, namespace, redirect, wikitext = "", "0", False, ""
    for child in page:
        name = _local_name(child.tag)
        if name == "title":
            title = child.text or ""
        elif name == "ns":
            namespace = (child.text or "0").strip()
        elif name == "redirect":
            redirect = True
        elif name == "revision":
            for field in child:
                if _local_name(field.tag) == "text":
                    wikitext = field.text or ""
    return title, namespace, redirect, wikitext


def _read_dump_file(path: Path, skips: SkipCounter, convert: bool = True) -> Iterator[Document]:
    num_pages = 0
    try:
        with open_binary(path) as stream:
            root = None
            for event, element in ElementTree.iterparse(stream, events=("start", "end")):
                if root is None:
                    root = element  # <mediawiki>: cleared after each page so finished pages are freed
                if event != "end" or _local_name(element.tag) != "page":
                    continue
                num_pages += 1
                title, namespace, redirect, wikitext = _page_fields(element)
                root.clear()
                if redirect:
                    skips.skip("redirect")
                    continue
                if namespace != "0":
                    skips.skip("namespace")
                    continue
                source = f"{path}#page{num_pages}"
                if not convert:
                    yield Document(title=title, text=wikitext, source=source, markup="wikitext")
                    continue
                text = wikitext_to_text(wikitext)
                if not text:
                    skips.skip("empty")
                    continue
                yield Document(title=title, text=text, source=source)
    except ElementTree.ParseError as error:
        line, column = error.position
        raise DataError(
            f"{path}: malformed XML at line {line}, column {column} (after page {num_pages}): "
            f"{one_line(error)}"
        ) from error
    except STREAM_ERRORS as error:
        raise DataError(
            f"{path}: truncated or corrupt file after page {num_pages}: {one_line(error)}"
        ) from error
