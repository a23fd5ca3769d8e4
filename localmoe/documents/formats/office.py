"""Word (python-docx) and PowerPoint (python-pptx) files."""

from __future__ import annotations

import zipfile
from pathlib import Path

from localmoe.documents.formats.base import Parsed, UnreadableFile
from localmoe.documents.records import Section


def _open_error(path: Path, what: str, error: Exception) -> UnreadableFile:
    return UnreadableFile(f"not a readable {what} file ({type(error).__name__}: {error}); it may be corrupt or "
                          "truncated: open and re-save it")


def _table_lines(table) -> list[str]:
    """A table as ' | '-joined rows (cells merged across columns repeat in python-docx; keep one)."""
    lines = []
    for row in table.rows:
        cells: list[str] = []
        for cell in row.cells:
            text = " ".join(cell.text.split())
            if not cells or text != cells[-1]:
                cells.append(text)
        lines.append(" | ".join(cells))
    return lines


def read_docx(path: Path) -> Parsed:
    """Paragraphs and tables in document order; one line per paragraph / table row."""
    import docx
    from docx.opc.exceptions import PackageNotFoundError
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    try:
        document = docx.Document(str(path))
    except (PackageNotFoundError, zipfile.BadZipFile, KeyError, ValueError, OSError) as e:
        raise _open_error(path, "DOCX", e) from None
    lines: list[str] = []
    for block in document.element.body.iterchildren():
        tag = block.tag.rsplit("}", 1)[-1]
        if tag == "p":
            text = Paragraph(block, document).text.strip()
            if text:
                lines.append(text)
        elif tag == "tbl":
            lines.extend(_table_lines(Table(block, document)))
    return Parsed("docx", [Section("", "\n".join(lines), unit="paragraph")] if lines else [])


def read_pptx(path: Path) -> Parsed:
    """One section per slide: its text frames, tables and speaker notes."""
    import pptx
    from pptx.exc import PackageNotFoundError

    try:
        deck = pptx.Presentation(str(path))
    except (PackageNotFoundError, zipfile.BadZipFile, KeyError, ValueError, OSError) as e:
        raise _open_error(path, "PPTX", e) from None
    sections, problems = [], []
    for number, slide in enumerate(deck.slides, start=1):
        lines: list[str] = []
        for shape in slide.shapes:
            if shape.has_text_frame:
                lines.extend(p for p in (" ".join(par.text.split()) for par in shape.text_frame.paragraphs) if p)
            if getattr(shape, "has_table", False) and shape.has_table:
                lines.extend(" | ".join(" ".join(c.text.split()) for c in row.cells) for row in shape.table.rows)
        if slide.has_notes_slide and slide.notes_slide.notes_text_frame is not None:
            notes = slide.notes_slide.notes_text_frame.text.strip()
            if notes:
                lines.append(f"Notes: {notes}")
        if lines:
            sections.append(Section(f"slide {number}", "\n".join(lines)))
        else:
            problems.append(f"slide {number} has no text")
    return Parsed("pptx", sections, pages=len(deck.slides), problems=problems)
