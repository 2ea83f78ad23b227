"""WikiExtractor output (attardi/wikiextractor): folders of `wiki_NN` files, optionally `.bz2`/`.gz`.

Each article is a block

    <doc id="12" url="https://en.wikipedia.org/wiki?curid=12" title="Anarchism">
    Anarchism

    First paragraph on one line.
    ...
    </doc>

whose first line repeats the title. Files are read line by line (streaming), so file size does not
matter. Every line is decoded as strict UTF-8: a replacement character in the training text would be
silent corruption, so an article with an undecodable line is skipped and counted instead.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from pathlib import Path

from data.config import SourceConfig
from data.documents import DataError, Document, SkipCounter
from data.sources.files import STREAM_ERRORS, check_not_binary, one_line, open_binary, resolve_paths

EXTRACTED_PATTERNS = ("wiki_*",)
UTF8_BOM = b"\xef\xbb\xbf"
_DOC_START = re.compile(rb"^\s*<doc\b([^>]*)>\s*$")
_DOC_END = re.compile(rb"^\s*</doc>\s*$")
_TITLE_ATTRIBUTE = re.compile(rb'\btitle="([^"]*)"')


def read_wiki_extracted(cfg: SourceConfig, skips: SkipCounter) -> Iterator[Document]:
    """Articles of the WikiExtractor output at `cfg.path`: one file, a folder (every `wiki_*` file
    below it, recursively, sorted by path) or a glob.

    Yields Document(title from the `title` attribute, text = the block without its title line, one
    paragraph per line). Counts "non_utf8" (an undecodable line) and "empty" (no text) skips. Raises
    DataError naming the file and line for a `<doc>` opened inside an open one, a `</doc>` without an
    open one, a block still open at the end of the file, text outside any block, a binary file, or
    a truncated/corrupt compressed file.
    """
    assert cfg.path is not None, "SourceConfig requires a path for local sources"
    for path in resolve_paths(cfg.path, EXTRACTED_PATTERNS, "WikiExtractor (wiki_*)"):
        yield from _read_extracted_file(path, skips)


def _read_extracted_file(path: Path, skips: SkipCounter) -> Iterator[Document]:
    line_number = 0
    try:
        check_not_binary(path)
        with open_binary(path) as stream:
            title: str | None = None
            start_line = 0
            lines: list[str] = []
            undecodable = False
            for raw_line in stream:
                line_number += 1
                if line_number == 1:
                    raw_line = raw_line.removeprefix(UTF8_BOM)
                start = _DOC_START.match(raw_line)
                if start is not None:
                    if title is not None:
                        raise DataError(
                            f"{path}:{line_number}: <doc> opened inside the <doc> of line {start_line}"
                        )
                    start_line, lines = line_number, []
                    title, undecodable = _title(start.group(1))
                    continue
                if _DOC_END.match(raw_line):
                    if title is None:
                        raise DataError(f"{path}:{line_number}: </doc> without an open <doc>")
                    document = _finish(title, lines, undecodable, f"{path}:{start_line}", skips)
                    if document is not None:
                        yield document
                    title = None
                    continue
                if title is None:
                    if raw_line.strip():
                        raise DataError(
                            f"{path}:{line_number}: text outside a <doc> block (not WikiExtractor output?)"
                        )
                    continue
                try:
                    lines.append(raw_line.decode("utf-8"))
                except UnicodeDecodeError:
                    undecodable = True
            if title is not None:
                raise DataError(f"{path}:{start_line}: <doc> not closed before the end of the file")
    except STREAM_ERRORS as error:
        raise DataError(
            f"{path}: truncated or corrupt file near line {line_number}: {one_line(error)}"
        ) from error


def _title(attributes: bytes) -> tuple[str, bool]:
    """(the `title` attribute unescaped, whether it failed to decode). The title is "" when absent:
    the first line of the block is used then."""
    match = _TITLE_ATTRIBUTE.search(attributes)
    if match is None:
        return "", False
    try:
        return html.unescape(match.group(1).decode("utf-8")), False
    except UnicodeDecodeError:
        return "", True


def _finish(
    title: str, lines: list[str], undecodable: bool, source: str, skips: SkipCounter
) -> Document | None:
    if undecodable:
        skips.skip("non_utf8")
        return None
    title_line = lines[0].strip() if lines else ""
    paragraphs = [stripped for stripped in (line.strip() for line in lines[1:]) if stripped]
    if not paragraphs:
        skips.skip("empty")
        return None
    return Document(title=title or title_line, text="\n".join(paragraphs), source=source)
