"""Document sources: one reader per `SourceKind`, chained by `iter_documents`.

A reader is a generator `read_<kind>(cfg: SourceConfig, skips: SkipCounter) -> Iterator[Document]`:
it streams documents in a deterministic order, counts what it skips (by reason) in `skips`, and
raises `DataError` with a one-line message naming the file (and line or page) for bad input. Adding
a source is one module, one line in `SOURCES`, one `SourceKind` value and its tests.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from data.config import SourceConfig, SourceKind
from data.documents import DataError, Document, SkipCounter
from data.sources.books import read_books
from data.sources.hub import read_hub_bookcorpus, read_hub_wikipedia
from data.sources.wiki_dump import read_wiki_dump
from data.sources.wiki_extracted import read_wiki_extracted

Reader = Callable[[SourceConfig, SkipCounter], Iterator[Document]]

SOURCES: dict[SourceKind, Reader] = {
    SourceKind.hub_wikipedia: read_hub_wikipedia,
    SourceKind.hub_bookcorpus: read_hub_bookcorpus,
    SourceKind.wiki_dump: read_wiki_dump,
    SourceKind.wiki_extracted: read_wiki_extracted,
    SourceKind.books: read_books,
}


def iter_documents(
    sources: list[SourceConfig], skips: SkipCounter, *, defer_wikitext: bool = False
) -> Iterator[Document]:
    """The documents of every source, source by source in the order given, each source cut at its
    `max_documents` (skipped documents do not count towards it).

    A reader's DataError is re-raised as one line prefixed with the source's place in the config,
    e.g. `data.sources[1] (books): /data/books does not exist`. With `defer_wikitext`, dump pages come
    as raw wikitext (`Document.plain_text()` converts them) so the conversion can run in workers.
    """
    for index, cfg in enumerate(sources):
        kind = SourceKind(cfg.kind)
        if defer_wikitext and kind is SourceKind.wiki_dump:  # the caller converts (data.pipeline)
            reader = read_wiki_dump(cfg, skips, convert=False)
        else:
            reader = SOURCES[kind](cfg, skips)
        try:
            yield from itertools.islice(reader, cfg.max_documents)
        except DataError as error:
            raise DataError(f"data.sources[{index}] ({kind.value}): {error}") from error
        finally:
            # A source cut short by max_documents releases its open file now, not at garbage collection.
            close = getattr(reader, "close", None)
            if close is not None:
                close()
