"""File helpers shared by the local readers: resolving a path/folder/glob, opening compressed files,
refusing binary files, and keeping error messages on one line."""

from __future__ import annotations

import bz2
import glob
import gzip
import io
from collections.abc import Iterable
from fnmatch import fnmatch
from pathlib import Path

from data.documents import DataError

BINARY_PROBE_BYTES = 8192
# Errors a damaged or cut-off compressed stream raises on read: bz2/gzip raise EOFError when the
# stream ends early and OSError (gzip.BadGzipFile included) on corrupt data.
STREAM_ERRORS = (EOFError, OSError)
_GLOB_CHARACTERS = frozenset("*?[")


def one_line(message: object) -> str:
    """The message with its line breaks folded, so every DataError prints as a single line."""
    return " ".join(str(message).split())


def resolve_paths(path: str, patterns: Iterable[str], what: str) -> list[Path]:
    """The files a source reads, in a deterministic order.

    `path` is a file (taken whatever its name), a folder (searched recursively for file names
    matching any of `patterns`, hidden files and folders excluded, sorted by relative path) or a
    glob (sorted matches). Raises DataError when nothing exists there or nothing matches; `what`
    names the expected kind of file in that message.
    """
    patterns = tuple(patterns)
    location = Path(path).expanduser()
    if location.is_file():
        return [location]
    if location.is_dir():
        found = sorted(
            candidate
            for candidate in location.rglob("*")
            if candidate.is_file()
            and not any(part.startswith(".") for part in candidate.relative_to(location).parts)
            and any(fnmatch(candidate.name, pattern) for pattern in patterns)
        )
        if not found:
            raise DataError(f"{location}: folder holds no {what} files ({', '.join(patterns)})")
        return found
    if _GLOB_CHARACTERS & set(path):
        found = sorted(Path(match) for match in glob.glob(str(location), recursive=True))
        found = [candidate for candidate in found if candidate.is_file()]
        if not found:
            raise DataError(f"{path}: the pattern matches no files")
        return found
    raise DataError(f"{location} does not exist")


def open_binary(path: Path) -> io.BufferedIOBase:
    """Open for reading bytes, decompressing `.bz2` and `.gz` transparently (streaming, not in memory)."""
    if path.suffix == ".bz2":
        return bz2.open(path, "rb")
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")  # the caller owns and closes the stream


def check_not_binary(path: Path) -> None:
    """Raise DataError when the first bytes of the (decompressed) file hold a NUL byte: text corpora
    never do, so the path points at the wrong file (an archive, an image, a model). A damaged
    compressed file raises one of STREAM_ERRORS here already."""
    with open_binary(path) as stream:
        head = stream.read(BINARY_PROBE_BYTES)
    if b"\x00" in head:
        raise DataError(f"{path}: binary file (NUL bytes in the first {BINARY_PROBE_BYTES} bytes), not text")
