"""The unit every source yields, the data error type and the skip counter reported in manifests."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from data.wikitext import wikitext_to_text


class DataError(ValueError):
    """Bad user data: the message is one line naming the file (and line/page where known)."""


@dataclass(frozen=True)
class Document:
    """One article or book. `text` is plain text; paragraphs are separated by newlines."""

    title: str
    text: str
    source: str  # where it came from: a file path (plus page/line) or a hub dataset id
    # "text", or "wikitext" for dump pages whose conversion is deferred to the preparation workers
    # (the conversion is the costliest part of reading; done there it runs in parallel)
    markup: str = "text"

    def plain_text(self) -> str:
        """The plain text: `text`, or the converted wikitext ("" when nothing survives cleaning)."""
        if self.markup == "wikitext":
            return wikitext_to_text(self.text)
        return self.text


class SkipCounter(Counter):
    """Counts of documents or records skipped, by reason; written into the manifest."""

    def skip(self, reason: str, count: int = 1) -> None:
        self[reason] += count

    def as_dict(self) -> dict[str, int]:
        return {reason: int(n) for reason, n in sorted(self.items())}
