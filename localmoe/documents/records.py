"""The data the document pipeline passes around: ingested files, their sections, chunks
and the problems met on the way."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

PICTURE_NOTE = "(this page has no text layer; its picture is attached)"  # the text of a picture-only section


@dataclass
class Section:
    """A located piece of a file: a PDF page, a sheet, a slide, a part of a text file.

    `unit` names what one line of `text` is ("line", "row", "paragraph") when the
    section may be split on line boundaries; `first` is the number of its first line and
    `header` a line repeated at the top of every chunk (a table's column names); `image` is the
    section rendered as a picture (a PDF page holding a figure or little text)."""

    location: str  # "page 3", "sheet Revenue", "slide 2", "" (a whole text file)
    text: str
    unit: str | None = None
    first: int = 1
    header: str | None = None
    image: bytes | None = field(default=None, repr=False)  # the section rendered as a picture (a PDF page)

    def span(self, start: int, stop: int) -> str:
        """Location of lines start..stop (0-based, stop exclusive) of this section."""
        if self.unit is None:
            return self.location
        a, b = self.first + start, self.first + stop - 1
        where = f"{self.unit} {a}" if a == b else f"{self.unit}s {a}-{b}"
        return f"{self.location}, {where}" if self.location else where


@dataclass
class Document:
    path: Path
    kind: str  # "pdf", "docx", "pptx", "xlsx", "csv", "html", "markdown", "text", "code"
    sections: list[Section]
    pages: int = 0  # PDF pages (or slides / sheets): what ingestion throughput is counted in
    display: str = ""  # how citations name the file: relative to the folder given, or the path as given

    @property
    def name(self) -> str:
        return self.display or str(self.path)


@dataclass
class FileProblem:
    """Something wrong with one file (or one page of it); the rest of the batch goes on."""

    path: Path
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass
class Ingested:
    documents: list[Document] = field(default_factory=list)
    problems: list[FileProblem] = field(default_factory=list)

    @property
    def pages(self) -> int:
        return sum(d.pages or len(d.sections) for d in self.documents)


@dataclass
class Chunk:
    """A retrievable, citable span of text: what the model sees as passage [P<id>]."""

    id: int
    source: str  # the file, as shown to the user
    location: str
    text: str
    image: bytes | None = field(default=None, repr=False)  # the page's picture, shown to a vision model with the text

    @property
    def where(self) -> str:
        return f"{self.source}, {self.location}" if self.location else self.source


@dataclass
class Passage:
    """A search hit."""

    source: str
    location: str
    text: str
    score: float

    def to_dict(self) -> dict:
        return {"source": self.source, "location": self.location, "text": self.text, "score": self.score}
