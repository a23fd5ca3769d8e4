"""Plain text, Markdown and source code: the file's lines, cited by line number."""

from __future__ import annotations

from pathlib import Path

from localmoe.documents.formats.base import Parsed, UnreadableFile
from localmoe.documents.records import Section

TEXT_SUFFIXES = (".txt", ".text", ".log", ".rst", ".org", ".tex", ".json", ".jsonl", ".yaml", ".yml", ".toml",
                 ".ini", ".cfg", ".xml", ".srt")
MARKDOWN_SUFFIXES = (".md", ".markdown", ".mdx")
CODE_SUFFIXES = (".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".rs", ".go", ".java", ".kt", ".scala",
                 ".js", ".jsx", ".ts", ".tsx", ".rb", ".php", ".swift", ".m", ".cs", ".sh", ".bash", ".zsh",
                 ".sql", ".r", ".jl", ".lua", ".pl", ".hs", ".ml", ".ex", ".exs", ".erl", ".clj", ".dart",
                 ".vue", ".svelte", ".css", ".scss", ".proto", ".cmake", ".mk", ".dockerfile", ".zig", ".nim")


def looks_like_text(path: Path, probe: int = 8192) -> bool:
    """UTF-8 without NUL bytes in the first `probe` bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(probe)
    except OSError:
        return False
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 4  # a multi-byte character cut at the probe's end
    return True


def read_text(path: Path) -> Parsed:
    raw = path.read_bytes()
    if b"\0" in raw[:8192]:
        raise UnreadableFile("binary data, not text; analyse PDF, office, HTML, text or source files")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    suffix = path.suffix.lower()
    kind = "markdown" if suffix in MARKDOWN_SUFFIXES else "code" if suffix in CODE_SUFFIXES else "text"
    lines = text.splitlines()
    if not any(line.strip() for line in lines):
        return Parsed(kind, [], pages=0, problems=["no text (only whitespace)"])
    return Parsed(kind, [Section("", "\n".join(lines), unit="line")])
