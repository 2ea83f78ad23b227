"""Local plain-text books (the BookCorpus stand-in): `.txt`, `.txt.gz` or `.gz` files.

Project Gutenberg files carry a header and a licence around the book; only the body between the
`*** START OF ... PROJECT GUTENBERG EBOOK` and `*** END OF ...` markers is kept, without the
producer credits that open it and the "End of the Project Gutenberg EBook" line that closes it.
Hard-wrapped lines are joined into paragraphs (paragraphs are separated by blank lines).

Encoding: UTF-8 (with or without BOM; ASCII is UTF-8). Anything else is skipped and counted as
"non_utf8" rather than guessed: a cp1252/latin-1 guess decodes every byte sequence, so a wrong guess
would put mojibake into the corpus silently.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

from data.config import SourceConfig
from data.documents import DataError, Document, SkipCounter
from data.sources.files import STREAM_ERRORS, check_not_binary, one_line, open_binary, resolve_paths

log = logging.getLogger(__name__)

BOOK_PATTERNS = ("*.txt", "*.txt.gz", "*.gz")
_START_MARKER = re.compile(
    r"^.*\*\*\* ?START OF (?:THIS|THE) PROJECT GUTENBERG EBOOK.*$", re.IGNORECASE | re.MULTILINE
)
_END_MARKER = re.compile(
    r"^.*\*\*\* ?END OF (?:THIS|THE) PROJECT GUTENBERG EBOOK", re.IGNORECASE | re.MULTILINE
)
_TITLE_LINE = re.compile(r"^Title:[ \t]*(\S.*?)\s*$", re.MULTILINE)
# Without markers the title header, if any, sits in the first lines.
_HEADER_CHARACTERS_WITHOUT_MARKERS = 4096
_BLANK_LINES = re.compile(r"\n[ \t]*\n\s*")
_WHITESPACE = re.compile(r"\s+")
# Boilerplate paragraphs just inside the markers: producer credits and the closing PG line.
_OPENING_CREDITS = re.compile(
    r"^(?:produced by|transcribed (?:from|by)|prepared by|e-?text prepared by|this e-?text was prepared)",
    re.IGNORECASE,
)
_CLOSING_LINE = re.compile(r"^end of (?:the )?project gutenberg", re.IGNORECASE)


def read_books(cfg: SourceConfig, skips: SkipCounter) -> Iterator[Document]:
    """One Document per book at `cfg.path`: a file, a folder (recursively `*.txt`, `*.txt.gz`, `*.gz`,
    sorted by path) or a glob.

    Title: the `Title:` header line when present, else the file name without its suffixes. Text: the
    body (see the module docstring), one paragraph per line. Counts "non_utf8" and "empty" skips.
    Raises DataError on a missing path, an empty folder, a binary file or a corrupt `.gz`.
    """
    assert cfg.path is not None, "SourceConfig requires a path for local sources"
    for path in resolve_paths(cfg.path, BOOK_PATTERNS, "book (.txt/.gz)"):
        try:
            check_not_binary(path)
            with open_binary(path) as stream:
                raw = stream.read()
        except STREAM_ERRORS as error:
            raise DataError(f"{path}: truncated or corrupt file: {one_line(error)}") from error
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            log.warning("%s: skipped, not UTF-8 (byte %d)", path, error.start)
            skips.skip("non_utf8")
            continue
        title, body = split_gutenberg(text)
        paragraphs = join_paragraphs(body)
        if not paragraphs:
            skips.skip("empty")
            continue
        yield Document(title=title or _stem(path), text=paragraphs, source=str(path))


def split_gutenberg(text: str) -> tuple[str | None, str]:
    """(title from the `Title:` header or None, body without the Project Gutenberg header, licence
    and boilerplate). Text without markers is returned whole."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = _START_MARKER.search(text)
    header = text[: start.start()] if start else text[:_HEADER_CHARACTERS_WITHOUT_MARKERS]
    title_match = _TITLE_LINE.search(header)
    body_start = start.end() if start else 0
    end = _END_MARKER.search(text, body_start)
    body = text[body_start : end.start() if end else len(text)]
    if start or end:
        body = _strip_boilerplate_paragraphs(body)
    return (title_match.group(1) if title_match else None), body


def join_paragraphs(text: str) -> str:
    """Paragraphs separated by blank lines, each with its hard-wrapped lines joined by single spaces,
    one paragraph per output line. Text without any blank line is taken as one paragraph per line."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").strip()
    if not text:
        return ""
    if _BLANK_LINES.search(text) is None:
        blocks = text.split("\n")
    else:
        blocks = _BLANK_LINES.split(text)
    paragraphs = (_WHITESPACE.sub(" ", block).strip() for block in blocks)
    return "\n".join(paragraph for paragraph in paragraphs if paragraph)


def _strip_boilerplate_paragraphs(body: str) -> str:
    blocks = _BLANK_LINES.split(body.strip())
    if blocks and _OPENING_CREDITS.match(blocks[0]):
        blocks = blocks[1:]
    if blocks and _CLOSING_LINE.match(blocks[-1]):
        blocks = blocks[:-1]
    return "\n\n".join(blocks)


def _stem(path: Path) -> str:
    """`11-0.txt.gz` -> `11-0`."""
    name = path.name
    for suffix in (".gz", ".txt"):
        name = name.removesuffix(suffix)
    return name
