"""Document sources on the real shared sample and on bad inputs written to tmp_path."""

from __future__ import annotations

import bz2
import gzip
import re
from pathlib import Path

import pytest

from data.config import SourceConfig, SourceKind
from data.documents import DataError, Document, SkipCounter
from data.sources import SOURCES, iter_documents
from data.sources.books import read_books
from data.sources.hub import read_hub_bookcorpus, read_hub_wikipedia
from data.sources.wiki_dump import read_wiki_dump, wikitext_to_text
from data.sources.wiki_extracted import read_wiki_extracted

DUMP_NAME = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
# Markup that must never reach the training text.
WIKI_MARKUP = ("{{", "}}", "[[", "]]", "<ref", "</ref", "{|", "|}", "Category:", "File:", "Image:", "thumb|")
WIKI_MARKUP += ("<!--", "&nbsp;", "&amp;", "''", "==", "__NOTOC__")
# Words in the Project Gutenberg body, by provenance, minus the boilerplate paragraphs inside the
# markers that the reader drops ("Produced by ...", "End of the Project Gutenberg EBook ...").
BOOK_WORDS = {
    "11-0": 26_460 - 11,
    "120-0": 68_609 - 9 - 10,
    "14263": 62_126 - 16 - 12,
    "15122": 57_767 - 17 - 11,
    "16215": 152_131 - 15 - 9,
    "3261": 77_840 - 14,
}
BOOK_TITLES = {
    "Alice’s Adventures in Wonderland",
    "Treasure Island",
    "Katrine",
    "The Little Colonel's Hero",
    "Jack Sheppard",
    "News from Nowhere",
}


def config(kind: SourceKind, path: Path | str | None = None, **overrides) -> SourceConfig:
    return SourceConfig(kind=kind, path=None if path is None else str(path), **overrides)


def read(reader, kind: SourceKind, path: Path | str, **overrides) -> tuple[list[Document], dict[str, int]]:
    skips = SkipCounter()
    documents = list(reader(config(kind, path, **overrides), skips))
    return documents, skips.as_dict()


def assert_one_line_error(error: pytest.ExceptionInfo, *expected: str) -> None:
    message = str(error.value)
    assert "\n" not in message, message
    for fragment in expected:
        assert fragment in message, message


def xml_dump(pages: str, schema: str = "0.11") -> str:
    namespace = f"http://www.mediawiki.org/xml/export-{schema}/"
    opening = f'<mediawiki xmlns="{namespace}" version="{schema}" xml:lang="en">'
    return f"{opening}\n<siteinfo/>\n{pages}</mediawiki>\n"


def page(title: str, wikitext: str, namespace: int = 0, redirect: str | None = None) -> str:
    redirect_element = f'<redirect title="{redirect}" />' if redirect else ""
    escaped = wikitext.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return (
        f"<page><title>{title}</title><ns>{namespace}</ns><id>1</id>{redirect_element}"
        f"<revision><id>2</id><text xml:space='preserve'>{escaped}</text></revision></page>\n"
    )


def extracted_block(identifier: int, title: str, *paragraphs: str) -> str:
    url = f"https://en.wikipedia.org/wiki?curid={identifier}"
    body = "\n\n".join(paragraphs)
    return f'<doc id="{identifier}" url="{url}" title="{title}">\n{title}\n\n{body}\n</doc>\n'


# --- registry and chaining -------------------------------------------------------------------------


def test_registry_has_a_reader_for_every_source_kind():
    assert set(SOURCES) == set(SourceKind)


def test_iter_documents_chains_sources_in_order_and_honours_max_documents(shared_data: Path):
    skips = SkipCounter()
    sources = [
        config(SourceKind.wiki_extracted, shared_data / "wikipedia/extracted/AB", max_documents=3),
        config(SourceKind.books, shared_data / "books/gutenberg", max_documents=2),
        config(SourceKind.wiki_extracted, shared_data / "wikipedia/extracted/AA", max_documents=1),
    ]
    titles = [document.title for document in iter_documents(sources, skips)]
    assert titles == [
        "Grapheme",
        "Glass",
        "Gel electrophoresis",
        "Alice’s Adventures in Wonderland",
        "Treasure Island",
        "Anarchism",
    ]
    assert skips.as_dict() == {}


def test_iter_documents_names_the_failing_source(tmp_path: Path, shared_data: Path):
    missing = tmp_path / "no_books_here"
    sources = [
        config(SourceKind.wiki_extracted, shared_data / "wikipedia/extracted/AA", max_documents=1),
        config(SourceKind.books, missing),
    ]
    with pytest.raises(DataError) as error:
        list(iter_documents(sources, SkipCounter()))
    assert_one_line_error(error, "data.sources[1] (books)", f"{missing} does not exist")


@pytest.mark.parametrize(
    "kind", [SourceKind.wiki_dump, SourceKind.wiki_extracted, SourceKind.books, SourceKind.hub_wikipedia]
)
def test_missing_path_is_one_line_naming_it(tmp_path: Path, kind: SourceKind):
    missing = tmp_path / "missing"
    with pytest.raises(DataError) as error:
        list(SOURCES[kind](config(kind, missing), SkipCounter()))
    assert_one_line_error(error, f"{missing} does not exist")


# --- raw MediaWiki dump --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dump_result(shared_data: Path) -> tuple[list[Document], dict[str, int]]:
    """The 6 MB dump parsed once for the module."""
    return read(read_wiki_dump, SourceKind.wiki_dump, shared_data / "wikipedia" / DUMP_NAME)


def test_wiki_dump_counts(dump_result):
    documents, skips = dump_result
    assert len(documents) == 106
    assert skips == {"redirect": 100}  # the one non-article namespace page is a redirect too
    titles = [document.title for document in documents]
    assert len(set(titles)) == 106
    assert {"Anarchism", "Autism", "Algorithm", "American Revolutionary War"} <= set(titles)
    assert all(DUMP_NAME in document.source for document in documents)


def test_wiki_dump_text_has_no_markup(dump_result):
    documents, _ = dump_result
    for document in documents:
        for markup in WIKI_MARKUP:
            assert markup not in document.text, f"{markup!r} in {document.title}"
        assert re.search(r"https?://", document.text) is None, document.title
        lines = document.text.split("\n")
        assert all(line and line == line.strip() for line in lines), document.title


def test_wiki_dump_keeps_prose_and_link_text_and_drops_headings(dump_result):
    documents, _ = dump_result
    anarchism = next(document for document in documents if document.title == "Anarchism")
    assert anarchism.text.startswith(
        "Anarchism is a political philosophy that advocates self-governed societies"
    )
    # [[Maximilien de Robespierre|Robespierre]] keeps its text, [[Hébertists]] its title.
    assert "(as Robespierre did the Hébertists)" in anarchism.text
    lines = set(anarchism.text.split("\n"))
    assert not {"History", "Etymology and terminology", "Origins", "References"} & lines
    assert sum(len(document.text) for document in documents) > 2_500_000


def test_wikitext_to_text_on_every_construct():
    wikitext = (
        "{{Infobox person|name=X|spouse={{marriage|Y|1900}}}}\n"
        "'''Ada''' was a [[mathematician|mathematic]]ian<ref name=\"a/b\"/> from [[London]].<ref>{{cite web"
        "|url=http://x.org}}</ref> She wrote [http://example.org notes] (http://bare.example.org).\n"
        "<!-- hidden remark -->\n"
        "== Life ==\n"
        "[[File:Ada.jpg|thumb|A portrait of [[Ada Lovelace]]]]\n"
        "She met [[Charles Babbage|Babbage]] in 1833 &ndash; a turning point&nbsp;(see {{lang|fr|texte}}).\n"
        '{| class="wikitable"\n|-\n| cell || {{flag|UK}}\n|}\n'
        "* first item\n"
        "# second item\n"
        "__NOTOC__\n"
        "<math>\\frac{{a}}{b}</math>\n"
        "[[Category:Mathematicians]]\n"
        "[[de:Ada Lovelace]]\n"
    )
    assert wikitext_to_text(wikitext) == (
        "Ada was a mathematician from London. She wrote notes.\n"
        "She met Babbage in 1833 – a turning point (see).\n"
        "first item\n"
        "second item"
    )


def test_wikitext_with_unbalanced_braces_falls_back_to_the_parser():
    assert wikitext_to_text("Text {{cite|a}} more {{unclosed and [[link]] end.") == (
        "Text more {{unclosed and link end."
    )


def test_wiki_dump_skips_namespaces_redirects_and_empty_pages(tmp_path: Path):
    pages = (
        page("Article", "An [[article]] body.")
        + page("Talk:Article", "A talk page.", namespace=1)
        + page("Old name", "#REDIRECT [[Article]]", redirect="Article")
        + page("Stub", "{{only a template}}\n[[Category:Stubs]]")
    )
    plain = tmp_path / "dump-pages-articles.xml"
    plain.write_text(xml_dump(pages), encoding="utf-8")
    compressed = tmp_path / "dump-pages-articles2.xml.bz2"
    compressed.write_bytes(bz2.compress(xml_dump(pages, schema="0.10").encode()))
    for path in (plain, compressed):
        documents, skips = read(read_wiki_dump, SourceKind.wiki_dump, path)
        assert [(document.title, document.text) for document in documents] == [
            ("Article", "An article body.")
        ]
        assert skips == {"namespace": 1, "redirect": 1, "empty": 1}
    documents, _ = read(read_wiki_dump, SourceKind.wiki_dump, tmp_path)  # a folder: both files, sorted
    assert [document.source for document in documents] == [f"{plain}#page1", f"{compressed}#page1"]


def test_truncated_bz2_dump_is_one_line_naming_the_file(tmp_path: Path, shared_data: Path):
    truncated = tmp_path / "truncated-pages-articles.xml.bz2"
    truncated.write_bytes((shared_data / "wikipedia" / DUMP_NAME).read_bytes()[:150_000])
    with pytest.raises(DataError) as error:
        list(read_wiki_dump(config(SourceKind.wiki_dump, truncated), SkipCounter()))
    assert_one_line_error(error, str(truncated), "after page")


def test_malformed_xml_dump_names_file_and_line(tmp_path: Path):
    broken = tmp_path / "broken.xml"
    broken.write_text(xml_dump(page("Good", "Fine text.") + "<page><title>Bad</titel></page>\n"))
    skips = SkipCounter()
    documents = read_wiki_dump(config(SourceKind.wiki_dump, broken), skips)
    assert next(documents).title == "Good"
    with pytest.raises(DataError) as error:
        next(documents)
    assert_one_line_error(error, str(broken), "line 4", "after page 1")


# --- WikiExtractor output ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("relative_path", "count", "first", "last"),
    [
        ("wikipedia/extracted", 103, "Anarchism", "GRE Physics Test"),
        ("wikipedia/extracted/AA", 37, "Anarchism", "Amphibian"),
        ("wikipedia/extracted/AB/wiki_00", 66, "Grapheme", "GRE Physics Test"),
    ],
)
def test_wiki_extracted_counts(shared_data: Path, relative_path: str, count: int, first: str, last: str):
    documents, skips = read(read_wiki_extracted, SourceKind.wiki_extracted, shared_data / relative_path)
    assert len(documents) == count and skips == {}
    assert (documents[0].title, documents[-1].title) == (first, last)
    assert documents[0].text.startswith(
        "Anarchism is an anti-authoritarian" if first == "Anarchism" else "In "
    )
    for document in documents:
        assert "<doc" not in document.text and "</doc>" not in document.text
        assert document.text.split("\n")[0] != document.title  # the title line is dropped
        assert "\n\n" not in document.text and document.text == document.text.strip()
    assert documents[0].source.endswith("wiki_00:1")


def test_wiki_extracted_reads_compressed_files_in_sorted_order(tmp_path: Path):
    folder = tmp_path / "extracted"
    (folder / "AB").mkdir(parents=True)
    (folder / "AA").mkdir()
    (folder / "AB" / "wiki_00.bz2").write_bytes(bz2.compress(extracted_block(3, "Third", "C.").encode()))
    (folder / "AA" / "wiki_01.gz").write_bytes(gzip.compress(extracted_block(2, "Second", "B.").encode()))
    (folder / "AA" / "wiki_00").write_text(extracted_block(1, "AT&amp;T", "First para.", "Second para."))
    (folder / "README.md").write_text("not WikiExtractor output\n")
    documents, skips = read(read_wiki_extracted, SourceKind.wiki_extracted, folder)
    assert [(document.title, document.text) for document in documents] == [
        ("AT&T", "First para.\nSecond para."),
        ("Second", "B."),
        ("Third", "C."),
    ]
    assert skips == {}


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            extracted_block(1, "A", "x").replace("</doc>\n", "") + extracted_block(2, "B", "y"),
            ":5: <doc> opened inside the <doc> of line 1",
        ),
        (extracted_block(1, "A", "x") + '<doc id="2" title="B">\nB\n\nunclosed\n', ":6: <doc> not closed"),
        (extracted_block(1, "A", "x") + "</doc>\n", ":6: </doc> without an open <doc>"),
        ("stray text\n" + extracted_block(1, "A", "x"), ":1: text outside a <doc> block"),
    ],
)
def test_malformed_doc_blocks_name_file_and_line(tmp_path: Path, content: str, expected: str):
    path = tmp_path / "wiki_00"
    path.write_text(content)
    with pytest.raises(DataError) as error:
        list(read_wiki_extracted(config(SourceKind.wiki_extracted, path), SkipCounter()))
    assert_one_line_error(error, f"{path}{expected}")


def test_wiki_extracted_skips_documents_that_are_not_utf8_or_empty(tmp_path: Path):
    path = tmp_path / "wiki_00"
    latin1 = extracted_block(2, "Bad", "caf\xe9 au lait").encode("latin-1")
    path.write_bytes(
        extracted_block(1, "Good", "Fine.").encode() + latin1 + extracted_block(3, "Empty").encode()
    )
    documents, skips = read(read_wiki_extracted, SourceKind.wiki_extracted, path)
    assert [document.title for document in documents] == ["Good"]
    assert skips == {"non_utf8": 1, "empty": 1}


def test_binary_and_empty_inputs_are_errors(tmp_path: Path):
    binary = tmp_path / "wiki_00"
    binary.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)
    with pytest.raises(DataError) as error:
        list(read_wiki_extracted(config(SourceKind.wiki_extracted, binary), SkipCounter()))
    assert_one_line_error(error, str(binary), "binary file")
    empty = tmp_path / "empty"
    empty.mkdir()
    for kind in (SourceKind.wiki_extracted, SourceKind.books, SourceKind.wiki_dump):
        with pytest.raises(DataError) as error:
            list(SOURCES[kind](config(kind, empty), SkipCounter()))
        assert_one_line_error(error, str(empty), "holds no")


# --- books ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def books_result(shared_data: Path) -> tuple[list[Document], dict[str, int]]:
    return read(read_books, SourceKind.books, shared_data / "books/gutenberg")


def test_books_counts_titles_and_bodies(books_result):
    documents, skips = books_result
    assert skips == {}
    assert {document.title for document in documents} == BOOK_TITLES
    for document in documents:
        stem = Path(document.source).name.removesuffix(".txt.gz")
        assert len(document.text.split()) == BOOK_WORDS[stem], stem
        lowered = document.text.lower()
        for boilerplate in ("gutenberg", "*** start of", "*** end of", "pgdp.net", "pglaf", "\r", "\ufeff"):
            assert boilerplate not in lowered, (stem, boilerplate)
        assert not lowered.startswith(("produced by", "transcribed from")), stem


def test_books_join_hard_wrapped_lines(books_result):
    documents, _ = books_result
    alice = next(document for document in documents if document.title.startswith("Alice"))
    paragraphs = alice.text.split("\n")
    assert paragraphs[0] == "ALICE’S ADVENTURES IN WONDERLAND" and paragraphs[-1] == "THE END"
    assert any(
        paragraph.startswith("Alice was beginning to get very tired of sitting by her sister on the bank,")
        and paragraph.endswith("thought Alice ‘without pictures or conversations?’")
        for paragraph in paragraphs
    )


def test_books_without_markers_bom_crlf_and_bad_encodings(tmp_path: Path):
    folder = tmp_path / "books"
    (folder / "nested").mkdir(parents=True)
    (folder / "plain_story.txt").write_bytes("\ufeffOne line\r\nwrapped.\r\n\r\nNext.\r\n".encode())
    (folder / "nested" / "titled.txt.gz").write_bytes(
        gzip.compress(b"Title: A Titled Book\n\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nBody.\n")
    )
    (folder / "latin1.txt").write_bytes("Caf\xe9 story.".encode("latin-1"))
    (folder / "only_licence.txt").write_text(
        "Header\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nLicence.\n"
    )
    (folder / "notes.md").write_text("not a book")
    documents, skips = read(read_books, SourceKind.books, folder)
    assert [(document.title, document.text) for document in documents] == [
        ("A Titled Book", "Body."),
        ("plain_story", "One line wrapped.\nNext."),
    ]
    assert skips == {"non_utf8": 1, "empty": 1}
    globbed, _ = read(read_books, SourceKind.books, folder / "*.txt")
    assert [document.title for document in globbed] == ["plain_story"]


def test_binary_and_truncated_books_are_errors(tmp_path: Path, shared_data: Path):
    truncated = tmp_path / "book.txt.gz"
    truncated.write_bytes((shared_data / "books/gutenberg/11-0.txt.gz").read_bytes()[:20_000])
    binary = tmp_path / "model.txt"
    binary.write_bytes(b"\x00\x01\x02" * 100)
    for path, expected in ((truncated, "truncated or corrupt"), (binary, "binary file")):
        with pytest.raises(DataError) as error:
            list(read_books(config(SourceKind.books, path), SkipCounter()))
        assert_one_line_error(error, str(path), expected)


# --- Hugging Face datasets (local copies with the hub schema) --------------------------------------


WIKIPEDIA_ROWS = {
    "id": ["12", "25", "39"],
    "url": [f"https://en.wikipedia.org/wiki?curid={i}" for i in (12, 25, 39)],
    "title": ["Anarchism", "Autism", "Albedo"],
    "text": ["Anarchism is a philosophy.\n\nHistory\n\nIt is old.", "", "Albedo is reflection."],
}


def test_hub_wikipedia_from_local_parquet_folder(tmp_path: Path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "wikipedia"
    folder.mkdir()
    datasets.Dataset.from_dict(WIKIPEDIA_ROWS).to_parquet(str(folder / "train-00000-of-00001.parquet"))
    documents, skips = read(read_hub_wikipedia, SourceKind.hub_wikipedia, folder)
    assert [(document.title, document.text) for document in documents] == [
        ("Anarchism", "Anarchism is a philosophy.\nHistory\nIt is old."),
        ("Albedo", "Albedo is reflection."),
    ]
    assert skips == {"empty": 1}
    assert documents[1].source == f"{folder}#39"


def test_hub_bookcorpus_from_saved_dataset_and_jsonl(tmp_path: Path):
    datasets = pytest.importorskip("datasets")
    rows = {"title": ["book-one.epub.txt"], "text": ["Chapter 1\n\nIt was a\ndark night.\n\nThe end."]}
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(saved))
    jsonl = tmp_path / "books.jsonl"
    datasets.Dataset.from_dict(rows).to_json(str(jsonl))
    for path, streaming in ((saved, False), (jsonl, True)):
        documents, _ = read(read_hub_bookcorpus, SourceKind.hub_bookcorpus, path, streaming=streaming)
        assert [(document.title, document.text) for document in documents] == [
            ("book-one.epub.txt", "Chapter 1\nIt was a dark night.\nThe end.")
        ]
    with pytest.raises(DataError) as error:
        list(read_hub_bookcorpus(config(SourceKind.hub_bookcorpus, saved, split="validation"), SkipCounter()))
    assert_one_line_error(error, str(saved), "no split 'validation'")


def test_hub_missing_column_and_missing_name_are_errors(tmp_path: Path):
    datasets = pytest.importorskip("datasets")
    sentences_only = tmp_path / "bookcorpus"
    datasets.Dataset.from_dict({"text": ["One sentence.", "Another."]}).save_to_disk(str(sentences_only))
    with pytest.raises(DataError) as error:
        list(read_hub_bookcorpus(config(SourceKind.hub_bookcorpus, sentences_only), SkipCounter()))
    assert_one_line_error(error, str(sentences_only), "no column 'title'")
    with pytest.raises(DataError) as error:
        list(read_hub_wikipedia(config(SourceKind.hub_wikipedia), SkipCounter()))
    assert_one_line_error(error, "needs 'hub_name' or 'path'")


def test_no_import_circle_between_documents_and_the_dump_reader():
    """`data.documents` converts deferred wikitext through `data.wikitext`, which imports nothing of
    `data`: importing either module first works, and the converter loads no source module (#17 item 7)."""
    import subprocess
    import sys

    probe = (
        "import sys, data.wikitext; assert not [m for m in sys.modules if m.startswith('data.') and "
        "m != 'data.wikitext'], sorted(sys.modules); import data.sources.wiki_dump, data.documents"
    )
    for code in (probe, "import data.documents, data.sources.wiki_dump", "import data.sources.wiki_dump"):
        subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
    page = Document(title="t", text="'''Bold''' [[link|text]] here.{{cite|x}}", source="s", markup="wikitext")
    assert page.plain_text() == wikitext_to_text(page.text) == "Bold text here."
