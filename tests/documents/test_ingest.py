"""Ingestion recovers each planted fact at its page / sheet / slide, and every bad file gets its own message."""

from __future__ import annotations

import pytest

from localmoe.documents import collect_files, ingest
from localmoe.documents.chunks import chunk_documents, split_section
from localmoe.documents.records import PICTURE_NOTE, Section
from localmoe.errors import LocalMoEError
from tests.documents import builders


def _flat(text: str) -> str:
    return " ".join(text.split())


def _locations_of(ingested, needle: str) -> list[tuple[str, str]]:
    return [(d.path.name, s.location) for d in ingested.documents for s in d.sections if needle in _flat(s.text)]


def test_pdf_pages_hold_their_facts(tmp_path):
    pdf = builders.write_pdf(tmp_path / "r.pdf", pages=9)
    ingested = ingest([pdf])
    (document,) = ingested.documents
    assert document.kind == "pdf" and document.pages == 9
    assert [s.location for s in document.sections] == [f"page {n}" for n in range(1, 10)]
    for page, fact in builders.PDF_FACTS.items():
        assert _locations_of(ingested, fact) == [("r.pdf", f"page {page}")]
    assert ingested.problems == []


def test_office_and_html_facts_found_where_planted(corpus):
    folder, files = corpus
    ingested = ingest([folder])
    assert sorted(d.path.name for d in ingested.documents) == sorted(p.name for p in files.values())
    assert _locations_of(ingested, builders.DOCX_FACT) == [("handbook.docx", "")]
    assert _locations_of(ingested, builders.PPTX_FACT[1]) == [("update.pptx", f"slide {builders.PPTX_FACT[0]}")]
    assert _locations_of(ingested, builders.HTML_FACT) == [("services.html", 'section "Library"')]
    sheet, customer, amount = builders.XLSX_FACT
    assert _locations_of(ingested, f"{customer} | {amount} | south") == [("ledger.xlsx", f"sheet {sheet}")]
    assert "do not index" not in " ".join(s.text for d in ingested.documents for s in d.sections)  # <script>


def test_chunks_keep_row_numbers_and_table_header(tmp_path):
    sheet, customer, _ = builders.XLSX_FACT
    ingested = ingest([builders.write_xlsx(tmp_path / "l.xlsx")])
    chunks = chunk_documents(ingested.documents, size=200)
    revenue = [c for c in chunks if c.location.startswith(f"sheet {sheet}")]
    assert len(revenue) > 1
    assert all(c.text.splitlines()[0] == "customer | amount | region" for c in revenue)
    (hit,) = [c for c in revenue if customer in c.text]
    # the fact is the sheet's last row: 1 header + 30 filler rows + it = row 32
    assert hit.location.endswith("-32")
    assert hit.source == str(tmp_path / "l.xlsx")


def test_text_chunks_cite_line_ranges():
    lines = [f"line {i} " + "word " * 20 for i in range(1, 41)]
    pieces = split_section(Section("", "\n".join(lines), unit="line"), size=300)
    assert len(pieces) > 2
    covered = []
    for location, text in pieces:
        first, last = (int(n) for n in location.removeprefix("lines ").split("-"))
        assert text.splitlines()[0].startswith(f"line {first} ") and text.splitlines()[-1].startswith(f"line {last} ")
        covered.extend(range(first, last + 1))
    assert covered == list(range(1, 41))


def test_bad_files_each_get_a_message_and_the_rest_is_read(tmp_path):
    good = builders.write_pdf(tmp_path / "good.pdf", pages=4)
    builders.write_pdf(tmp_path / "scan.pdf", pages=3, facts={2: "Second page sentence here."}, blank_pages=(3,))
    builders.write_encrypted_pdf(tmp_path / "locked.pdf", good)
    (tmp_path / "broken.docx").write_bytes(b"PK\x03\x04 this is not a real zip archive")
    (tmp_path / "empty.txt").write_bytes(b"")
    builders.write_docx(tmp_path / "fine.docx")
    ingested = ingest([tmp_path])
    assert sorted(d.path.name for d in ingested.documents) == ["fine.docx", "good.pdf", "scan.pdf"]
    messages = {p.path.name: p.message for p in ingested.problems}
    assert set(messages) == {"scan.pdf", "locked.pdf", "broken.docx", "empty.txt"}
    assert "page 3 has no text layer" in messages["scan.pdf"]
    assert "encrypted" in messages["locked.pdf"] and "password" in messages["locked.pdf"]
    assert "DOCX" in messages["broken.docx"] and "corrupt" in messages["broken.docx"]
    assert "0 bytes" in messages["empty.txt"]
    scan = next(d for d in ingested.documents if d.path.name == "scan.pdf")
    assert [s.location for s in scan.sections] == ["page 1", "page 2", "page 3"]  # page 3: its picture alone
    assert scan.sections[2].text == PICTURE_NOTE and scan.sections[2].image[:8] == b"\x89PNG\r\n\x1a\n"


def test_globs_and_skipped_folders(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    (tmp_path / "src" / "b.md").write_text("# b\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config.txt").write_text("hidden\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / "vendor").mkdir()
    (tmp_path / "vendor" / "c.py").write_text("y = 2\n")
    assert [p.name for p in collect_files([tmp_path])] == ["a.py", "b.md", "c.py"]
    assert [p.name for p in collect_files([tmp_path], include=["*.py"])] == ["a.py", "c.py"]
    assert [p.name for p in collect_files([tmp_path], exclude=["vendor"])] == ["a.py", "b.md"]
    with pytest.raises(LocalMoEError, match="no such file"):
        collect_files([tmp_path / "missing"])


def test_csv_is_a_table(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("city;population\nOslo;709000\nBergen;291000\n")
    (document,) = ingest([path]).documents
    (section,) = document.sections
    assert section.text.splitlines() == ["city | population", "Oslo | 709000", "Bergen | 291000"]
    assert section.header == "city | population"
