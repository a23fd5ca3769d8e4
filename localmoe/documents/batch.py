"""Batch jobs: every question of a questions file over each document of a folder, one report
per document. Each report is written atomically (temp file, fsync, rename) and carries a
fingerprint of its inputs, so a rerun skips finished documents and a crash loses none."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from localmoe.documents.analysis import analyse
from localmoe.documents.asker import ServiceAsker
from localmoe.documents.ingest import collect_named, read_document
from localmoe.documents.records import FileProblem, Ingested
from localmoe.errors import LocalMoEError

FORMATS = ("md", "json")
MARK = "<!-- localmoe analyze fingerprint="  # first line of a Markdown report

# (documents done, documents in all, the document, "done" | "skipped" | "failed")
Progress = Callable[[int, int, str, str], None]


def read_questions(path: Path) -> list[str]:
    """One question per line; blank lines and lines starting with # are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LocalMoEError(f"{path}: cannot read the questions file ({e})") from None
    questions = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not questions:
        raise LocalMoEError(f"{path}: no questions (write one question per line)")
    return questions


def write_atomically(path: Path, text: str) -> None:
    """`text` to `path` so that `path` either holds the whole text or is as it was (temp + fsync + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)


def fingerprint(path: Path, questions: list[str], budget: str, model: str) -> str:
    """What a finished report depends on: the file's size and mtime, the questions, budget and model."""
    stat = path.stat()
    key = json.dumps([stat.st_size, stat.st_mtime_ns, questions, budget, model])
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def report_path(out_dir: Path, display: str, fmt: str) -> Path:
    """Where the report of the document shown as `display` goes (its relative path, mirrored under out_dir)."""
    relative = Path(display)
    if relative.is_absolute() or ".." in relative.parts:
        relative = Path(relative.name)
    return out_dir / f"{relative}.{fmt}"


def finished(path: Path, mark: str) -> bool:
    """Whether `path` is a complete report made from the same inputs."""
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(4096)
    except OSError:
        return False
    return f"fingerprint={mark} " in head or f'"fingerprint": "{mark}"' in head


def render(display: str, mark: str, reports, fmt: str, problems: list[FileProblem]) -> str:
    if fmt == "json":
        return json.dumps({"fingerprint": mark, "document": display, "reports": [r.to_dict() for r in reports],
                           "problems": [{"path": str(p.path), "message": p.message} for p in problems]},
                          ensure_ascii=False, indent=2) + "\n"
    parts = [f"{MARK}{mark} -->", f"# {display}", ""]
    parts += [r.to_markdown(level=2) for r in reports]
    return "\n".join(parts)


@dataclass
class BatchResult:
    done: list[Path] = field(default_factory=list)  # reports written by this run
    skipped: list[Path] = field(default_factory=list)  # reports an earlier run finished
    problems: list[FileProblem] = field(default_factory=list)  # documents without a report, and why
    seconds: float = 0.0


async def run_batch(service, paths: list[Path], questions: list[str], out_dir: Path, fmt: str = "md",
                    budget: str = "high", include: list[str] | None = None, exclude: list[str] | None = None,
                    progress: Progress | None = None, max_tokens: int | None = None, asker=None) -> BatchResult:
    """One report per document of `paths` answering every question; finished reports are kept and skipped."""
    if fmt not in FORMATS:
        raise LocalMoEError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")

    started = time.perf_counter()
    asker = asker or ServiceAsker(service, budget)
    model = getattr(service, "model_id", "") if service is not None else ""
    files = collect_named([Path(p) for p in paths], include, exclude)
    result = BatchResult()
    for done, (path, display) in enumerate(files, start=1):
        target = report_path(Path(out_dir), display, fmt)
        mark = fingerprint(path, questions, budget, model)
        if finished(target, mark):
            result.skipped.append(target)
            status = "skipped"
        else:
            document, problems = await asyncio.to_thread(read_document, path, display)
            if document is None:
                result.problems.extend(problems)
                status = "failed"
            else:
                ingested = Ingested([document], problems)
                reports = [await analyse(asker, ingested, q, budget, max_tokens=max_tokens) for q in questions]
                write_atomically(target, render(display, mark, reports, fmt, problems))
                result.done.append(target)
                status = "done"
        if progress is not None:
            progress(done, len(files), display, status)
    result.seconds = time.perf_counter() - started
    return result
