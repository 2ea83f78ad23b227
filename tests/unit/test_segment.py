"""clean_text and split_sentences: normalization, sentence boundaries, paragraph boundaries."""

from __future__ import annotations

import gzip
import sys
import unicodedata
from pathlib import Path

import pytest

from data.segment import DROPPED, LINE_BREAKS, SPACES, clean_text, split_sentences
from data.sources.books import join_paragraphs, split_gutenberg


def test_character_classes_cover_unicode_control_and_space_characters():
    control = {
        chr(code_point) for code_point in range(0x110000) if unicodedata.category(chr(code_point)) == "Cc"
    }
    assert control <= set(LINE_BREAKS) | set(SPACES) | set(DROPPED) | {"\n"}
    space_separators = {
        chr(code_point)
        for code_point in range(sys.maxunicode + 1)
        if unicodedata.category(chr(code_point)) == "Zs"
    }
    assert space_separators - {" "} <= set(SPACES)
    assert not set(LINE_BREAKS) & set(DROPPED) and not set(SPACES) & set(DROPPED)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("Cafe\u0301 au lait", "Café au lait"),  # NFC composes e + combining acute
        ("a  \t b\t\tc", "a b c"),
        ("one\r\ntwo\rthree", "one\ntwo\nthree"),
        ("  first  \n\n \n   second \n", "first\nsecond"),
        ("no\u00a0break and\u2009thin", "no break and thin"),
        ("bell\x07 null\x00 escape\x1b[0m end", "bell null escape[0m end"),
        ("zero\u200bwidth soft\u00adhyphen \ufeffbom", "zerowidth softhyphen bom"),
        ("line\u2028separator\x0cform feed", "line\nseparator\nform feed"),
        ("", ""),
        (" \n\t\n ", ""),
    ],
)
def test_clean_text(raw: str, expected: str):
    assert clean_text(raw) == expected


def test_clean_text_keeps_joiners_and_is_idempotent():
    text = "क्\u200dष and \u0645\u200cی\n  twice   spaced  "
    cleaned = clean_text(text)
    assert "\u200d" in cleaned and "\u200c" in cleaned
    assert clean_text(cleaned) == cleaned


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "Dr. Smith paid $3.50 for the book. He left at 5 p.m. on Monday.",
            ["Dr. Smith paid $3.50 for the book.", "He left at 5 p.m. on Monday."],
        ),
        (
            "Mr. and Mrs. Dursley were proud. The U.S. Army was founded in 1775.",
            ["Mr. and Mrs. Dursley were proud.", "The U.S. Army was founded in 1775."],
        ),
        ("Pi is about 3.14159. Version 1.2.3 is out.", ["Pi is about 3.14159.", "Version 1.2.3 is out."]),
        ('He said "Stop!" Then he ran. Why?', ['He said "Stop!"', "Then he ran.", "Why?"]),
        ("", []),
    ],
)
def test_split_sentences(text: str, expected: list[str]):
    assert split_sentences(clean_text(text)) == expected


def test_sentences_never_cross_paragraphs():
    text = "A heading without a full stop\nDr.\nSmith starts a paragraph. It ends here\n\n  \nLast one."
    assert split_sentences(text) == [
        "A heading without a full stop",
        "Dr.",
        "Smith starts a paragraph.",
        "It ends here",
        "Last one.",
    ]


def test_segmentation_of_a_real_book_loses_no_characters(shared_data: Path):
    raw = gzip.decompress((shared_data / "books/gutenberg/11-0.txt.gz").read_bytes()).decode("utf-8-sig")
    _, body = split_gutenberg(raw)
    text = clean_text(join_paragraphs(body))
    sentences = split_sentences(text)
    assert len(sentences) > 900
    assert all(sentence and "\n" not in sentence and sentence == sentence.strip() for sentence in sentences)
    assert "".join("".join(sentences).split()) == "".join(text.split())
    assert (
        "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing "
        "to do: once or twice she had peeped into the book her sister was reading, but it had no pictures "
        "or conversations in it, ‘and what is the use of a book,’ thought Alice ‘without pictures or "
        "conversations?’"
    ) in sentences
