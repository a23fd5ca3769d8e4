"""One reader per file format, chosen by suffix (text is sniffed when the suffix is unknown).

A reader takes a path and returns a `Parsed`; it raises `UnreadableFile` with a message
saying what is wrong and what to do when the whole file cannot be read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from localmoe.documents.formats.base import Parsed, UnreadableFile
from localmoe.documents.formats.html import read_html
from localmoe.documents.formats.office import read_docx, read_pptx
from localmoe.documents.formats.pdf import read_pdf
from localmoe.documents.formats.sheets import read_csv, read_xlsx
from localmoe.documents.formats.text import CODE_SUFFIXES, MARKDOWN_SUFFIXES, TEXT_SUFFIXES, looks_like_text, read_text

Reader = Callable[[Path], Parsed]

READERS: dict[str, Reader] = {
    ".pdf": read_pdf,
    ".docx": read_docx,
    ".pptx": read_pptx,
    ".xlsx": read_xlsx,
    ".xlsm": read_xlsx,
    ".csv": read_csv,
    ".tsv": read_csv,
    ".html": read_html,
    ".htm": read_html,
    **{s: read_text for s in (*TEXT_SUFFIXES, *MARKDOWN_SUFFIXES, *CODE_SUFFIXES)},
}

# formats people expect to work but that need another tool first
CONVERT_FIRST = {".doc": "an old Word file: save it as .docx", ".ppt": "an old PowerPoint file: save it as .pptx",
                 ".xls": "an old Excel file: save it as .xlsx", ".rtf": "RTF: save it as .docx or .txt"}


def reader_for(path: Path) -> Reader:
    """The reader of `path`; raises UnreadableFile for a format no reader handles."""
    suffix = path.suffix.lower()
    if suffix in READERS:
        return READERS[suffix]
    if suffix in CONVERT_FIRST:
        raise UnreadableFile(f"{CONVERT_FIRST[suffix]} and analyse that")
    if looks_like_text(path):
        return read_text
    raise UnreadableFile(f"unsupported file type {suffix or '(no suffix)'}: analyse PDF, DOCX, PPTX, XLSX, CSV, "
                         "HTML, Markdown, text or source files")


def supported(path: Path) -> bool:
    """Whether a folder walk should pick `path` up (known suffix, or text without one)."""
    suffix = path.suffix.lower()
    return suffix in READERS or suffix in CONVERT_FIRST or (suffix == "" and looks_like_text(path))


__all__ = ["READERS", "Parsed", "Reader", "UnreadableFile", "reader_for", "supported"]
