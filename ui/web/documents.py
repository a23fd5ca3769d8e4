"""Questions about uploaded documents, answered by `localmoe.documents.answer` in the chat pane.

The answer (markdown with citations) becomes an assistant bubble; a collapsible panel
above it shows the progress while the documents are read, then the checked citations and
any file that could not be read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

PROGRESS_POLL = 0.25  # seconds between looks at the progress while the answer is being worked out
PROGRESS_TITLE = "Reading the documents"
SOURCES_TITLE = "Sources"


STAGES = {"read": "reading files", "map": "reading passage groups", "answer": "answering"}
QUOTE_SHOWN = 200  # characters of a cited quote in the Sources panel


def progress_text(stage: str, done: int, total: int) -> str:
    return f"{STAGES.get(stage, stage)}: {done}/{total}"


def citation_line(citation, number: int | None = None) -> str:
    """`1. **notes.txt**, lines 10-40: “quoted words”` (a Citation of localmoe.documents)."""
    where = f"**{Path(citation.source).name}**" + (f", {citation.location}" if citation.location else "")
    quote = " ".join(citation.quote.split())
    text = where + (f": “{quote[:QUOTE_SHOWN]}”" if quote else "") + (" (attributed)" if citation.attributed else "")
    return f"{number}. {text}" if number is not None else f"- {text}"


def sources_markdown(report) -> str:
    """The answer's checked citations ([n] in the answer), the retrieved evidence (labelled uncited
    evidence when the answer cites nothing checkable), unreadable files."""
    lines = [citation_line(c, i) for i, c in enumerate(report.citations, 1)]
    if report.status == "not_found":
        lines.append("Not found in the documents: no passage matches the question.")
    if report.evidence:
        lines += ([""] if lines else []) + [f"**{report.evidence_title()}**: {report.evidence_note()}", ""]
        lines += [citation_line(c) for c in report.evidence]
    if report.rejected:
        lines.append(f"\n{len(report.rejected)} citation(s) in the answer failed the check and are marked "
                     f"[unverified].")
    lines += [f"- could not read **{Path(str(p.path)).name}**: {p.message}" for p in report.problems]
    return "\n".join(lines)


async def answer_documents(service, paths: list[Path], question: str, budget: str, transcript,
                           max_tokens: int | None = None) -> AsyncIterator[None]:
    """Answer `question` from `paths` into `transcript`; yields after each visible change."""
    from localmoe.documents import answer

    steps: list[str] = []
    panel = transcript.note("Reading " + ", ".join(p.name for p in paths), title=PROGRESS_TITLE, pending=True)
    yield

    def progress(stage: str, done: int, total: int) -> None:  # may be called from a worker thread: only appends
        steps.append(progress_text(stage, done, total))

    work = asyncio.ensure_future(answer(service, list(paths), question, budget=budget, progress=progress,
                                        max_tokens=max_tokens))
    shown = 0
    try:
        while not work.done():
            await asyncio.wait({work}, timeout=PROGRESS_POLL)
            if len(steps) > shown:
                shown = len(steps)
                transcript.messages[panel]["content"] = "\n".join(f"- {s}" for s in steps[-8:])
                yield
        report = work.result()
    except Exception as e:  # noqa: BLE001 - the user sees what failed, the page stays up
        transcript.messages[panel]["metadata"].update(title="Error: no answer from the documents",
                                                      status="done")
        transcript.messages[panel]["content"] = f"{type(e).__name__}: {e}"
        yield
        return
    finally:
        if not work.done():
            work.cancel()
    transcript.messages[panel]["metadata"].update(title=SOURCES_TITLE, status="done")
    transcript.messages[panel]["content"] = sources_markdown(report)
    transcript.note(report.answer or "(no answer)")
    transcript.last_turn = f"answered from {len(paths)} document{'s' if len(paths) != 1 else ''} · budget {budget}"
    yield
