"""Question answering over documents with checked citations.

When every passage fits the model's context (with room for the answer) the model reads
them all in one pass. Otherwise BM25 picks the passages closest to the question, they are
packed into context-sized groups, the model takes cited notes on each group (map), and
writes the answer from the notes (reduce). Either way the answer's citations are checked
against the passages they name before the report is built."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localmoe.documents import prompts
from localmoe.documents.asker import ServiceAsker
from localmoe.documents.chunks import chunk_documents
from localmoe.documents.citations import check_answer, evidence
from localmoe.documents.ingest import ingest
from localmoe.documents.records import Chunk, Ingested
from localmoe.documents.report import Report
from localmoe.documents.retrieval import Index

# (stage, done, total): stage is "read" (files), "map" (passage groups) or "answer"
Progress = Callable[[str, int, int], None]

PROMPT_OVERHEAD = 160  # tokens of chat template, instructions and question beyond the passages themselves
PASSAGE_OVERHEAD = 16  # the "[P12] file, page 3" line above each passage
EVIDENCE_SHARE = 0.5  # a retrieved passage is quoted as evidence when its BM25 score is this share of the best


@dataclass(frozen=True)
class Plan:
    """How much work a budget tier buys."""

    passages: int  # the most passages retrieval hands on (map-reduce)
    answer_tokens: int
    note_tokens: int  # per map call
    evidence: int  # retrieved passages quoted under "Evidence"


PLANS = {"low": Plan(passages=8, answer_tokens=192, note_tokens=96, evidence=2),
         "high": Plan(passages=32, answer_tokens=384, note_tokens=160, evidence=3),
         "max": Plan(passages=96, answer_tokens=768, note_tokens=256, evidence=5)}


def pack(chunks: list[Chunk], sizes: dict[int, int], room: int) -> list[list[Chunk]]:
    """Consecutive groups of chunks, each group's tokens at most `room` (a chunk too big alone is its own group)."""
    groups: list[list[Chunk]] = []
    used = room + 1
    for chunk in chunks:
        size = sizes[chunk.id] + PASSAGE_OVERHEAD
        if used + size > room:
            groups.append([])
            used = 0
        groups[-1].append(chunk)
        used += size
    return groups


async def analyse(asker, ingested: Ingested, question: str, budget: str = "high",
                  progress: Progress | None = None, max_tokens: int | None = None) -> Report:
    """The report for `question` over already ingested documents, asked through `asker` (ServiceAsker or alike)."""
    started = time.perf_counter()
    plan = PLANS[budget]
    usage = getattr(asker, "usage", None)
    before = (usage.prompt_tokens, usage.completion_tokens) if usage is not None else (0, 0)
    answer_tokens = max_tokens or plan.answer_tokens
    chunks = chunk_documents(ingested.documents)
    report = Report(question=question, answer="", problems=list(ingested.problems), budget=budget,
                    sources=[str(d.path) for d in ingested.documents])
    stats = {"pages": ingested.pages, "chunks": len(chunks), "passages_read": 0, "model_calls": 0}
    if not chunks:
        report.answer = "No text could be read from the documents given; see Problems."
        report.stats = {**stats, "seconds": time.perf_counter() - started}
        return report
    sizes = {c.id: asker.count(c.text) for c in chunks}
    question_tokens = asker.count(question)
    room = asker.context - answer_tokens - PROMPT_OVERHEAD - question_tokens
    index = Index(chunks)
    scored = index.search(question, max(plan.passages, plan.evidence))
    hits = [c for c, _ in scored]
    # evidence: only hits scoring near the best one (a lone shared word like "March" is no evidence)
    strong = [c for c, score in scored[:plan.evidence] if score >= EVIDENCE_SHARE * scored[0][1]]
    if sum(sizes.values()) + PASSAGE_OVERHEAD * len(chunks) <= room:
        report.mode, read = "long-context", chunks
        if progress:
            progress("answer", 0, 1)
        text = await asker.ask(prompts.ANSWER_SYSTEM, prompts.passages_prompt(question, chunks), answer_tokens)
        calls = 1
    else:
        report.mode = "map-reduce"
        read = hits[:plan.passages] or chunks[:1]
        map_room = asker.context - plan.note_tokens - PROMPT_OVERHEAD - question_tokens
        groups = pack(read, sizes, map_room)
        if len(groups) == 1:  # what retrieval kept fits in one pass: no notes needed
            if progress:
                progress("answer", 0, 1)
            text = await asker.ask(prompts.ANSWER_SYSTEM, prompts.passages_prompt(question, groups[0]),
                                   answer_tokens)
            calls = 1
        else:
            notes = []
            for i, group in enumerate(groups):
                if progress:
                    progress("map", i, len(groups))
                note = await asker.ask(prompts.MAP_SYSTEM, prompts.passages_prompt(question, group), plan.note_tokens)
                if note.strip() and note.strip().upper() != "NONE":
                    notes.append(note)
            if progress:
                progress("map", len(groups), len(groups))
                progress("answer", 0, 1)
            text = await asker.ask(prompts.REDUCE_SYSTEM, prompts.reduce_prompt(question, notes or ["NONE"]),
                                   answer_tokens)
            calls = len(groups) + 1
    checked = check_answer(text, chunks)
    report.answer, report.citations, report.rejected = checked.text, checked.citations, checked.rejected
    report.evidence = evidence(strong, question, chunks)
    if progress:
        progress("answer", 1, 1)
    stats.update(passages_read=len(read), model_calls=calls, seconds=time.perf_counter() - started)
    if usage is not None:
        stats.update(prompt_tokens=usage.prompt_tokens - before[0], completion_tokens=usage.completion_tokens - before[1])
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
