"""Citations: parsed from the model's answer, checked against the cited passage's text
before anything is printed.

The model is asked to cite as [P<id>: "<words copied from the passage>"]. A citation is
kept only when its passage exists and the quoted words occur in it (compared after folding
case, whitespace, quote marks and dashes); a citation without a quote is kept only when
the claim it ends shares most of its content words with the passage. A citation of a passage the
model was shown as a picture (a PDF page's chart or scan) that its text does not back is kept and
marked as resting on the picture. Everything else is rejected with the reason, and its marker in the
answer is flagged."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import asdict, dataclass

from localmoe.documents.records import Chunk
from localmoe.documents.retrieval import tokens

# [P12: "quoted words"]  [P12]  [p 12 - “quoted”]  ; several ids as [P3, P4] count as separate unquoted citations
MARKER = re.compile(r"\[\s*[Pp]\s*(\d+)\s*(?:[:,\-\u2013]\s*[\"\u201c\u201d']+(.*?)[\"\u201c\u201d']+\s*)?\]", re.DOTALL)
MULTI = re.compile(r"\[\s*[Pp]\s*\d+(?:\s*[,;]\s*[Pp]?\s*\d+)+\s*\]")
MIN_QUOTE_WORDS = 2  # "the" occurs everywhere: a quote must hold at least two words
SUPPORT_SHARE = 0.6  # an unquoted claim: this share of its content words must be in the passage
_TRANSLATE = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-", "\u2014": "-",
                            "\u00a0": " ", "\u00ad": None})


def normalize(text: str) -> str:
    """Case, width, quote marks, dashes, hyphenated line breaks and runs of whitespace folded."""
    text = unicodedata.normalize("NFKC", text).translate(_TRANSLATE).casefold()
    text = re.sub(r"-\s*\n\s*", "", text)  # "procure-\nment" as PDFs break words
    return " ".join(text.split())


@dataclass
class Citation:
    passage: int  # the chunk id cited
    source: str
    location: str
    quote: str
    claim: str  # the sentence the citation ends
    verified: bool
    reason: str = ""  # why it was rejected
    attributed: bool = False  # attached after generation by matching the claim's words (attribution.py)
    picture: bool = False  # it rests on the passage's picture (a figure, a scan), which no quote can be checked in

    def label(self) -> str:
        where = f"{self.source}, {self.location}" if self.location else self.source
        text = f'{where}: "{self.quote}"' if self.quote else where
        return text + (" (attributed)" if self.attributed else "") + (" (the page's picture)" if self.picture else "")

    def to_dict(self) -> dict:
        return asdict(self)


def quote_in(quote: str, text: str) -> bool:
    """Whether `quote` (normalized, with no trailing punctuation) occurs in `text`."""
    needle = normalize(quote).strip(" .,;:!?\"'")
    return bool(needle) and needle in normalize(text)


def check(chunk_id: int, quote: str, claim: str, chunks: dict[int, Chunk]) -> Citation:
    """One citation checked against the passage it names; one that its text does not back but its picture may
    (a chart, a scan the model was shown) is kept, marked as resting on the picture, without its quote."""
    cite = _check_text(chunk_id, quote, claim, chunks)
    chunk = chunks.get(chunk_id)
    if not cite.verified and chunk is not None and chunk.image is not None:
        return Citation(chunk_id, chunk.source, chunk.location, "", claim, True, picture=True)
    return cite


def _check_text(chunk_id: int, quote: str, claim: str, chunks: dict[int, Chunk]) -> Citation:
    chunk = chunks.get(chunk_id)
    if chunk is None:
        return Citation(chunk_id, "", "", quote, claim, False, f"there is no passage P{chunk_id}")
    quote = " ".join(quote.split())
    cite = Citation(chunk_id, chunk.source, chunk.location, quote, claim, True)
    if quote:
        if len(quote.split()) < MIN_QUOTE_WORDS:
            cite.verified, cite.reason = False, f"the quote {quote!r} is too short to check"
        elif not quote_in(quote, chunk.text):
            elsewhere = [c.id for c in chunks.values() if c.id != chunk_id and quote_in(quote, c.text)]
            cite.verified = False
            cite.reason = (f"the quote is not in P{chunk_id} ({chunk.where})" +
                           (f"; it is in P{elsewhere[0]}" if elsewhere else "; it is in no passage"))
        return cite
    words = set(tokens(claim))
    if not words:
        cite.verified, cite.reason = False, "a citation with neither a quote nor a claim"
        return cite
    have = set(tokens(chunk.text))
    share = len(words & have) / len(words)
    if share < SUPPORT_SHARE or len(words & have) < 2:
        cite.verified = False
        cite.reason = f"no quote, and P{chunk_id} holds only {share:.0%} of the claim's words"
    return cite


def _claim_before(text: str, at: int) -> str:
    """The sentence a marker at `at` ends (text back to the previous sentence end or marker)."""
    head = MARKER.sub(" ", text[:at])
    parts = re.split(r"(?<=[.!?])\s+|\n", head.rstrip())
    return parts[-1].strip() if parts else ""


@dataclass
class CheckedAnswer:
    text: str  # the answer with verified markers as [n] and rejected ones flagged
    citations: list[Citation]  # verified, numbered in order of first use
    rejected: list[Citation]


def check_answer(answer: str, chunks: list[Chunk]) -> CheckedAnswer:
    """Parse and check every citation marker in `answer`; number the verified ones [1], [2] ..."""
    by_id = {c.id: c for c in chunks}
    answer = MULTI.sub(lambda m: "".join(f"[P{n}]" for n in re.findall(r"\d+", m.group(0))), answer)
    verified: list[Citation] = []
    rejected: list[Citation] = []
    numbers: dict[tuple[int, str], int] = {}
    out, last = [], 0
    for match in MARKER.finditer(answer):
        cite = check(int(match.group(1)), match.group(2) or "", _claim_before(answer, match.start()), by_id)
        out.append(answer[last:match.start()])
        if cite.verified:
            key = (cite.passage, normalize(cite.quote))
            if key not in numbers:
                verified.append(cite)
                numbers[key] = len(verified)
            out.append(f"[{numbers[key]}]")
        else:
            rejected.append(cite)
            out.append("[unverified]")
        last = match.end()
    out.append(answer[last:])
    return CheckedAnswer("".join(out).strip(), verified, rejected)


def best_sentence(chunk: Chunk, question: str) -> str:
    """The sentence of `chunk` sharing most words with `question` (what the evidence list quotes)."""
    wanted = set(tokens(question))
    # tables: a row; prose: a sentence, with line-break hyphens joined as `normalize` joins them
    text = chunk.text if " | " in chunk.text else " ".join(re.sub(r"-\s*\n\s*", "", chunk.text).split())
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n", text) if len(s.split()) >= MIN_QUOTE_WORDS]
    if not sentences:
        return " ".join(chunk.text.split()[:30])
    return max(sentences, key=lambda s: (len(wanted & set(tokens(s))), -len(s)))


def evidence(hits: list[Chunk], question: str, chunks: list[Chunk]) -> list[Citation]:
    """For each retrieved chunk, its sentence closest to the question, checked like a model's citation."""
    by_id = {c.id: c for c in chunks}
    checked = [check(c.id, best_sentence(c, question), "", by_id) for c in hits]
    return [c for c in checked if c.verified]
