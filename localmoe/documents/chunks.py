"""Documents -> Chunks: the passages the model reads and cites.

A section is cut on line boundaries into pieces of about `size` characters; line-numbered
sections (text files, table rows, paragraphs) give each piece its own line range, and a
table's header row is repeated at the top of each piece so every chunk is a table."""

from __future__ import annotations

from localmoe.documents.records import Chunk, Document, Section

CHUNK_CHARS = 1200  # about 300 tokens of English: small enough to rank, big enough to hold a fact


def _cut_long_line(line: str, size: int) -> list[str]:
    """A line longer than `size` cut at spaces (or hard, when it has none)."""
    pieces = []
    while len(line) > size:
        at = line.rfind(" ", 0, size)
        at = at if at > size // 2 else size
        pieces.append(line[:at])
        line = line[at:].lstrip(" ")
    return pieces + [line]


def split_section(section: Section, size: int = CHUNK_CHARS) -> list[tuple[str, str]]:
    """(location, text) pieces of one section, each about `size` characters at most."""
    lines = section.text.split("\n")
    header = section.header
    body_start = 1 if header is not None and lines and lines[0] == header else 0
    pieces: list[tuple[str, str]] = []
    start, length, buffer = body_start, 0, []

    def emit(stop: int) -> None:
        text = "\n".join(buffer).strip("\n")
        if text.strip():
            if header is not None:
                text = f"{header}\n{text}"
            first = 0 if (header is not None and start == body_start and body_start == 1) else start
            pieces.append((section.span(first, stop), text))

    for i in range(body_start, len(lines)):
        line = lines[i]
        if section.unit is None and len(line) > size:
            parts = _cut_long_line(line, size)
        else:
            parts = [line]
        for part in parts:
            if buffer and length + len(part) + 1 > size:
                emit(i if part is parts[0] else i + 1)
                start, length, buffer = i, 0, []
            buffer.append(part)
            length += len(part) + 1
    if buffer:
        emit(len(lines))
    return pieces


def chunk_documents(documents: list[Document], size: int = CHUNK_CHARS) -> list[Chunk]:
    """Every document's sections as numbered chunks (ids count from 1 in document order)."""
    chunks: list[Chunk] = []
    for document in documents:
        source = document.name
        for section in document.sections:
            for k, (location, text) in enumerate(split_section(section, size)):  # the picture goes with the first
                chunks.append(Chunk(len(chunks) + 1, source, location, text, section.image if k == 0 else None))
    return chunks
