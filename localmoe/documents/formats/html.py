"""HTML pages (lxml): visible text, split into sections at h1-h3 headings."""

from __future__ import annotations

from pathlib import Path

from localmoe.documents.formats.base import Parsed, UnreadableFile
from localmoe.documents.records import Section

BLOCKS = {"p", "div", "li", "tr", "br", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "blockquote", "section",
          "article", "table", "ul", "ol", "dt", "dd", "td", "th", "caption", "title"}
HEADINGS = {"h1", "h2", "h3"}
SKIP = {"script", "style", "noscript", "template", "head"}


def read_html(path: Path) -> Parsed:
    import lxml.etree
    import lxml.html

    raw = path.read_bytes()
    try:
        root = lxml.html.document_fromstring(raw)
    except (lxml.etree.ParserError, ValueError) as e:
        raise UnreadableFile(f"not a readable HTML page ({e})") from None
    title = (root.findtext(".//title") or "").strip()
    sections: list[Section] = []
    heading, lines, current = "", [], []

    def flush_line():
        text = " ".join("".join(current).split())
        current.clear()
        if text:
            lines.append(text)

    def flush_section():
        flush_line()
        if lines:
            sections.append(Section(f'section "{heading}"' if heading else "", "\n".join(lines)))
        lines.clear()

    def walk(element):
        nonlocal heading
        tag = element.tag if isinstance(element.tag, str) else ""
        if tag in SKIP:
            current.append(" ")
            current.append(element.tail or "")
            return
        if tag in HEADINGS:
            flush_section()
            heading = " ".join(element.text_content().split())[:80]
        if tag in BLOCKS:
            flush_line()
        current.append(element.text or "")
        for child in element:
            walk(child)
        if tag in ("td", "th"):
            current.append(" | ")
        if tag in BLOCKS:
            flush_line()
        current.append(element.tail or "")

    body = root.find("body")
    walk(body if body is not None else root)
    flush_section()
    for s in sections:  # table rows end in a trailing separator
        s.text = "\n".join(line.rstrip(" |") for line in s.text.split("\n"))
    if title and sections and not sections[0].location:
        sections[0].location = f'section "{title[:80]}"'
    return Parsed("html", sections)
