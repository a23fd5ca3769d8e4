"""Spreadsheets (openpyxl) and CSV/TSV: tables kept as tables, one ' | '-joined line per row,
the header row repeated at the top of every chunk."""

from __future__ import annotations

import csv
import datetime
import zipfile
from pathlib import Path

from localmoe.documents.formats.base import Parsed, UnreadableFile
from localmoe.documents.records import Section


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, datetime.datetime) and value.time() == datetime.time():
        return value.date().isoformat()
    return " ".join(str(value).split())


def _table(location: str, rows: list[list[str]]) -> Section | None:
    """Rows (trailing empty rows and columns trimmed) as a section; line numbers are the sheet's row numbers."""
    while rows and not any(rows[-1]):
        rows.pop()
    if not rows:
        return None
    width = max((max((i + 1 for i, c in enumerate(r) if c), default=0) for r in rows), default=0)
    lines = [" | ".join(r[:width]) for r in rows]
    header = lines[0] if len(lines) > 1 else None
    return Section(location, "\n".join(lines), unit="row", first=1, header=header)


def read_xlsx(path: Path) -> Parsed:
    """One section per sheet (cached formula values, as Excel last computed them)."""
    import openpyxl
    from openpyxl.utils.exceptions import InvalidFileException

    try:
        book = openpyxl.load_workbook(str(path), read_only=True, data_only=True)
    except (InvalidFileException, zipfile.BadZipFile, KeyError, ValueError, OSError) as e:
        raise UnreadableFile(f"not a readable XLSX file ({type(e).__name__}: {e}); open and re-save it") from None
    sections, problems = [], []
    try:
        for sheet in book.worksheets:
            rows = [[_cell(v) for v in row] for row in sheet.iter_rows(values_only=True)]
            section = _table(f"sheet {sheet.title}", rows)
            if section is None:
                problems.append(f"sheet {sheet.title} is empty")
            else:
                sections.append(section)
    finally:
        book.close()
    return Parsed("xlsx", sections, pages=len(sections), problems=problems)


def read_csv(path: Path) -> Parsed:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    if delimiter == ",":
        try:
            delimiter = csv.Sniffer().sniff(text[:4096], delimiters=",;\t|").delimiter
        except csv.Error:
            pass
    try:
        rows = [[_cell(c) for c in row] for row in csv.reader(text.splitlines(), delimiter=delimiter)]
    except csv.Error as e:
        raise UnreadableFile(f"not a readable CSV file ({e})") from None
    section = _table("", rows)
    return Parsed("csv", [section] if section else [], pages=1)
