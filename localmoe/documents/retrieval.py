"""BM25 ranking of chunks (the bm25s package over our own word tokens)."""

from __future__ import annotations

import math
import re
from pathlib import Path

from localmoe.documents.chunks import chunk_documents
from localmoe.documents.records import Chunk, Passage

WORD = re.compile(r"[^\W_]+", re.UNICODE)
# common English words that carry no topic: dropped so a question's "what/was/the" do not rank
STOPWORDS = frozenset(re.findall(r"\w+", """a an and are as at be been but by did do does for from had has have how i if in into is it
its of on or our so such than that the their then there these they this to was we were what when where which who
whom why will with you your"""))


MATCH_SHARE = 1 / 3  # a passage is relevant when it holds this share of the question's content words
# words that ask about the documents as a whole rather than name a topic ("summarize the main points")
WHOLE = frozenset(["summarize", "summarise", "summary", "overview", "main", "document", "documents", "file", "files",
                   "describe", "explain", "key", "point", "points", "topic", "topics", "about", "tell", "me", "give",
                   "list", "text", "content", "contents", "say", "says", "said", "please", "briefly", "short"])


# a "when" (or date, year) question prefers passages holding a date: "29 June 2007", "February 1999", "March 3, 2021"
WHEN = re.compile(r"\b(when|date|year)\b", re.IGNORECASE)
MONTH = r"(?:january|february|march|april|may|june|july|august|september|october|november|december)"
DATE = re.compile(rf"\b{MONTH}\b[^.\n]{{0,12}}\b(?:1[89]|20)\d\d\b|\b\d{{1,2}}\s+{MONTH}\s+\d{{4}}\b", re.IGNORECASE)
DATE_BOOST = 1.5  # score factor for a passage holding a date, for a "when" question


def tokens(text: str) -> list[str]:
    """Lower-cased words and numbers, stopwords dropped; "12.5%" -> ["12", "5"]."""
    return [w for w in WORD.findall(text.casefold()) if w not in STOPWORDS]


def whole_document(question: str) -> bool:
    """Whether the question asks about the documents as a whole (no topic word of its own)."""
    words = set(tokens(question))
    return not words or words <= WHOLE


def relevant(question: str, texts: list[str]) -> bool:
    """Whether one of `texts` (retrieved passages) holds enough of the question's topic words to be about it."""
    words = set(tokens(question)) - WHOLE or set(tokens(question))
    need = max(1, math.ceil(len(words) * MATCH_SHARE))
    return any(len(words & set(tokens(text))) >= need for text in texts)


NOT_FOUND = "Not found in the documents: no passage matches the question's words ({words})."


def not_found(question: str, texts: list[str]) -> str | None:
    """The not-found answer when no text of `texts` (retrieved passages, "location text") is `relevant`
    to `question`, else None: the one rule analysis, /v1/documents/search and the search tool apply."""
    if relevant(question, texts):
        return None
    return NOT_FOUND.format(words=", ".join(sorted(set(tokens(question)))) or "none")


class Index:
    """A BM25 index over chunks; `search` returns (chunk, score) best first."""

    def __init__(self, chunks: list[Chunk]):
        import bm25s

        self.chunks = chunks
        self.bm25 = bm25s.BM25()
        corpus = [tokens(f"{c.location} {c.text}") or ["\u2205"] for c in chunks]  # bm25s needs no empty doc
        if chunks:
            self.bm25.index(corpus, show_progress=False)

    def search(self, query: str, top_k: int = 5) -> list[tuple[Chunk, float]]:
        words = tokens(query)
        if not self.chunks or not words or top_k < 1:
            return []
        known = [w for w in words if w in self.bm25.vocab_dict]
        if not known:
            return []
        k = min(2 * top_k, len(self.chunks))  # twice as many, so that a boost can lift one into the top_k
        ids, scores = self.bm25.retrieve([known], k=k, show_progress=False)
        hits = [(self.chunks[int(i)], float(s)) for i, s in zip(ids[0], scores[0]) if s > 0]
        if WHEN.search(query):
            hits = [(c, s * DATE_BOOST if DATE.search(c.text) else s) for c, s in hits]
            hits.sort(key=lambda hit: -hit[1])
        return hits[:top_k]


def search_documents(query: str, paths: list[Path], top_k: int = 5) -> list[Passage]:
    """The `top_k` passages of the files/folders `paths` that best match `query` (BM25), best first."""
    from localmoe.documents.ingest import ingest

    ingested = ingest([Path(p) for p in paths])
    index = Index(chunk_documents(ingested.documents))
    return [Passage(c.source, c.location, c.text, score) for c, score in index.search(query, top_k)]
