"""Text normalization and sentence splitting for NSP/MLM instance creation.

Both work on whole documents through C-level string operations (regular expressions over character
classes, `str.replace`, blingfire), never a Python loop over characters; the only Python loops run
over paragraphs. Sentences never cross a paragraph: blingfire treats a newline as a plain space, so
it is called once per paragraph.
"""

from __future__ import annotations

import re
import unicodedata

import blingfire

# Unicode control characters (category Cc: U+0000-001F, U+007F-009F) split three ways. Line and
# paragraph separators become "\n"; tab and the other space separators (category Zs) become " ";
# every other control character is dropped, as are invisible format characters that only break
# words apart (soft hyphen, zero-width space, word joiner, BOM). ZWJ/ZWNJ are kept: they change how
# some scripts render. tests/unit/test_segment.py checks these classes against unicodedata.
LINE_BREAKS = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
SPACES = "\t\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000"
DROPPED = (
    "".join(
        chr(code_point)
        for code_point in (*range(0x00, 0x20), *range(0x7F, 0xA0))
        if chr(code_point) not in LINE_BREAKS + SPACES + "\n"
    )
    + "\u00ad\u200b\u2060\ufeff"
)

_LINE_BREAK = re.compile(f"[{re.escape(LINE_BREAKS)}]")
_SPACE = re.compile(f"[{re.escape(SPACES)}]")
_DROPPED = re.compile(f"[{re.escape(DROPPED)}]")


def clean_text(text: str) -> str:
    """Unicode NFC; line breaks -> "\\n", tabs and other spaces -> " ", other control characters
    dropped; runs of spaces collapsed; spaces at line ends and blank lines removed.

    The result has one paragraph per line, no empty line, no leading or trailing whitespace.
    """
    if not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    text = _LINE_BREAK.sub("\n", text.replace("\r\n", "\n"))
    text = _SPACE.sub(" ", _DROPPED.sub("", text))
    while "  " in text:  # halves every run per pass: a handful of C-speed passes
        text = text.replace("  ", " ")
    return "\n".join(filter(None, (line.strip(" ") for line in text.split("\n"))))


def split_sentences(text: str) -> list[str]:
    """Sentences of `text` in order, by blingfire within each paragraph ("\\n"-separated line), so no
    sentence spans two paragraphs; empty ones dropped. Expects `clean_text` output: other text
    works, but keeps its own spacing inside sentences."""
    sentences: list[str] = []
    for paragraph in text.split("\n"):
        if paragraph and not paragraph.isspace():
            sentences.extend(filter(None, blingfire.text_to_sentences(paragraph).split("\n")))
    return sentences
