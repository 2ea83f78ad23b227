"""The unit every source yields, the data error type and the skip counter reported in manifests."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


class DataError(ValueError):
    """Bad user data: the message is one line naming the file (and line/page where known).

    Raised in a DataLoader worker, it reaches the main process rebuilt by torch's ExceptionWrapper as
    `DataError("Caught DataError in DataLoader worker process 0.\nOriginal Traceback ...")`; the
    constructor takes the one-line message back out of that text (kept whole in `worker_traceback`), so
    the error reads the same with or without workers. Any other message is kept as given.
    """

    def __init__(self, *args: object):
        self.worker_traceback: str | None = None
        if len(args) == 1 and isinstance(args[0], str):
            message = _unwrap_worker_message(type(self), args[0])
            if message is not None:
                self.worker_traceback, args = args[0], (message,)
        super().__init__(*args)


def _unwrap_worker_message(kind: type, text: str) -> str | None:
    """The original message in torch's `Caught <kind> in DataLoader worker ...` text, else None. The
    traceback's last entry reads `<module>.<name>: <message>` (the module left out for __main__)."""
    if not text.startswith(f"Caught {kind.__name__} ") or "\nOriginal Traceback" not in text:
        return None
    for prefix in (f"\n{kind.__module__}.{kind.__qualname__}: ", f"\n{kind.__qualname__}: "):
        position = text.rfind(prefix)
        if position >= 0:
            return text[position + len(prefix) :].rstrip("\n")
    return None


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
            from data.wikitext import wikitext_to_text  # the parser loads only where wikitext is read

            return wikitext_to_text(self.text)
        return self.text


class SkipCounter(Counter):
    """Counts of documents or records skipped, by reason; written into the manifest."""

    def skip(self, reason: str, count: int = 1) -> None:
        self[reason] += count

    def as_dict(self) -> dict[str, int]:
        return {reason: int(n) for reason, n in sorted(self.items())}
