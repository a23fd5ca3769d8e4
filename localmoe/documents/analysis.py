"""Question answering over documents with checked citations.

Every prompt is sized from real token counts (`fit.Fitter`). When every passage fits the
model's context with room for the answer, the model reads them all in one pass. Otherwise
BM25 picks the passages closest to the question, they are packed into as few prompts as fit
(at most the budget's number of calls), the model takes cited notes on each (map) and writes
the answer from the notes (reduce). The answer's citations are checked against the passages
they name; a sentence the model left uncited is cited to the passage it draws its words from when
one holds them (`attribution`, marked attributed); an answer without a checked citation comes with the retrieved passages labelled as
uncited evidence, and a question no passage matches is answered "not found in the documents".
A PDF page with a figure or little text carries its rendered picture; a model with a vision tower sees it
beside the page's text (in map-reduce those pages are read first, since retrieval cannot rank a picture), a
text model reads the text alone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from localmoe.documents import prompts
from localmoe.documents.asker import ServiceAsker
from localmoe.documents.attribution import attribute
from localmoe.documents.chunks import chunk_documents
from localmoe.documents.citations import check_answer, evidence
from localmoe.documents.fit import Fitter, fit_notes
from localmoe.documents.ingest import ingest
from localmoe.documents.records import PICTURE_NOTE, Chunk, Ingested
from localmoe.documents.report import Report
from localmoe.documents.retrieval import Index, not_found, whole_document

# (stage, done, total): stage is "read" (files), "map" (passage groups) or "answer"
Progress = Callable[[str, int, int], None]

EVIDENCE_SHARE = 0.9  # a retrieved passage is quoted as evidence when its score is this share of the best
ATTRIBUTION_HITS, ATTRIBUTION_SHARE = 2, 0.5  # an uncited sentence may be attributed to the 2 best hits (half the best score)


@dataclass(frozen=True)
class Plan:
    """How much work a budget tier buys."""

    passages: int  # the most passages retrieval hands on (map-reduce)
    calls: int  # the most map calls (one more writes the answer)
    answer_tokens: int
    note_tokens: int  # per map call
    evidence: int  # retrieved passages quoted under "Evidence"


PLANS = {"low": Plan(passages=8, calls=2, answer_tokens=192, note_tokens=96, evidence=1),
         "high": Plan(passages=32, calls=6, answer_tokens=384, note_tokens=160, evidence=2),
         "max": Plan(passages=96, calls=16, answer_tokens=768, note_tokens=256, evidence=3)}


def spread(chunks: list[Chunk], n: int) -> list[Chunk]:
    """`n` chunks evenly spaced through `chunks`, in order (what a whole-document question reads)."""
    if len(chunks) <= n:
        return list(chunks)
    return [chunks[i * len(chunks) // n] for i in range(n)]


async def _ask(asker, progress, stage, done, total, system, user, reply_tokens) -> str:
    if progress:
        progress(stage, done, total)
    return await asker.ask(system, user, reply_tokens)


async def _ask_passages(asker, progress, stage, done, total, system, question, chunks, reply_tokens) -> str:
    """Ask about `chunks`, their pictures shown with them (only a vision model's chunks carry pictures)."""
    text, pictures = prompts.passages_with_pictures(question, chunks)
    if progress:
        progress(stage, done, total)
    return await (asker.ask(system, text, reply_tokens, pictures) if pictures else asker.ask(system, text, reply_tokens))


def with_pictures(chunks: list[Chunk], sees: bool) -> list[Chunk]:
    """The chunks a model reads: with their page pictures for a vision model; for a text model without them, and
    without the picture-only pages (they hold no text)."""
    if sees:
        return chunks
    return [replace(c, image=None) for c in chunks if c.image is None or c.text != PICTURE_NOTE]


async def analyse(asker, ingested: Ingested, question: str, budget: str = "high",
                  progress: Progress | None = None, max_tokens: int | None = None) -> Report:
    """The report for `question` over already ingested documents, asked through `asker` (ServiceAsker or alike)."""
    started = time.perf_counter()
    plan = PLANS[budget]
    usage = getattr(asker, "usage", None)
    before = (usage.prompt_tokens, usage.completion_tokens, usage.loops) if usage is not None else (0, 0, 0)
    answer_tokens = max_tokens or plan.answer_tokens
    chunks = with_pictures(chunk_documents(ingested.documents), getattr(asker, "sees_images", False))
    report = Report(question=question, answer="", problems=list(ingested.problems), budget=budget,
                    sources=[str(d.path) for d in ingested.documents])
    stats = {"pages": ingested.pages, "chunks": len(chunks), "passages_read": 0, "model_calls": 0}
    if not chunks:
        report.status, report.mode = "no_text", "none"
        report.answer = "No text could be read from the documents given; see Problems."
        report.stats = {**stats, "seconds": time.perf_counter() - started}
        return report
    index = Index(chunks)
    scored = index.search(question, max(plan.passages, plan.evidence))
    whole = whole_document(question)
    missing = None if whole else not_found(question, [f"{c.location} {c.text}" for c, _ in scored])
    if missing:
        report.status, report.mode, report.answer = "not_found", "retrieval", missing
        report.stats = {**stats, "seconds": time.perf_counter() - started}
        return report
    hits = [c for c, _ in scored]
    # evidence: only hits scoring near the best one (a lone shared word like "March" is no evidence)
    strong = [c for c, score in scored[:plan.evidence] if score >= EVIDENCE_SHARE * scored[0][1]] if scored else []
    answer_fit = Fitter(asker, prompts.ANSWER_SYSTEM, question, answer_tokens)
    if answer_fit.fits(chunks):
        report.mode, read, calls = "long-context", chunks, 1
        text = await _ask_passages(asker, progress, "answer", 0, 1, prompts.ANSWER_SYSTEM, question, chunks,
                                   answer_tokens)
    else:
        report.mode = "map-reduce"
        wanted = spread(chunks, plan.passages) if whole and not hits else hits[:plan.passages]
        # retrieval cannot rank a picture by its words: the pages that have one are read too, first
        pictures = [c for c in chunks if c.image is not None][:plan.calls]
        wanted = pictures + [c for c in wanted if c.image is None or c not in pictures]
        single = answer_fit.pack(wanted, 1)[0]
        if len(single) == len(wanted):  # what retrieval kept fits in one pass: no notes needed
            read, calls = single, 1
            text = await _ask_passages(asker, progress, "answer", 0, 1, prompts.ANSWER_SYSTEM, question, single,
                                       answer_tokens)
        else:
            groups = Fitter(asker, prompts.MAP_SYSTEM, question, plan.note_tokens).pack(wanted, plan.calls)
            read = [c for g in groups for c in g]
            notes = []
            for i, group in enumerate(groups):
                note = await _ask_passages(asker, progress, "map", i, len(groups), prompts.MAP_SYSTEM, question,
                                           group, plan.note_tokens)
                if note.strip() and note.strip().upper().rstrip(".") != "NONE":
                    notes.append(note)
            notes = fit_notes(asker, prompts.REDUCE_SYSTEM, question, notes or ["NONE"], answer_tokens)
            if progress:
                progress("map", len(groups), len(groups))
            text = await _ask(asker, progress, "answer", 0, 1, prompts.REDUCE_SYSTEM,
                              prompts.reduce_prompt(question, notes), answer_tokens)
            calls = len(groups) + 1
    checked = check_answer(text, chunks)
    # sentences the model left uncited: cited to the passage they draw their words from, when it is one of
    # retrieval's best passages the model read (any passage read for a whole-document question)
    ids = {c.id for c in read}
    best = [c for c, score in scored[:ATTRIBUTION_HITS] if score >= ATTRIBUTION_SHARE * scored[0][1] and c.id in ids]
    text, attributed = attribute(checked.text, question, best if hits else read, len(checked.citations))
    report.answer, report.citations, report.rejected = text, checked.citations + attributed, checked.rejected
    # the strongest hits; when none of their sentences checks out, the first hit (or passage read) that does
    report.evidence = evidence(strong, question, chunks) or evidence((hits + read)[:16], question, chunks)[:1]
    report.status = "cited" if report.citations else "uncited"
    report.passages = {c.id: (c.source, c.location) for c in read}
    if progress:
        progress("answer", 1, 1)
    stats.update(passages_read=len(read), model_calls=calls, seconds=time.perf_counter() - started)
    if usage is not None:
        stats.update(prompt_tokens=usage.prompt_tokens - before[0], completion_tokens=usage.completion_tokens - before[1],
                     loops_stopped=usage.loops - before[2])
    report.stats = stats
    return report


async def answer(service, paths: list[Path], question: str, budget: str = "high", progress: Progress | None = None,
                 include: list[str] | None = None, exclude: list[str] | None = None,
                 max_tokens: int | None = None) -> Report:
    """Answer `question` over the files/folders `paths` with a started Service; citations checked."""
    asker = ServiceAsker(service, budget)
    question = question.strip()
    if not question:
        from localmoe.errors import LocalMoEError

        raise LocalMoEError("the question is empty; ask something about the documents")
    read = (lambda done, total, _path: progress("read", done, total)) if progress else None
    ingested = await asyncio.to_thread(ingest, [Path(p) for p in paths], include, exclude, read)
    return await analyse(asker, ingested, question, budget, progress, max_tokens)
