"""Citations attached after generation: each answer sentence that cites nothing is matched to the
passage of the prompt it draws its words from, and cited to it when the match holds.

A small model often answers from the passages without following the citation format. For each
such sentence, the passages the model read are ranked by the words they share with it; the best
one is cited when it holds most of the sentence's content words (the same support rule as a
model's unquoted citation, `citations.check`) and at least `NEW_WORDS` of them are words the
question did not already hold, so that a sentence which only repeats the question is never
attributed. The citation quotes the passage's sentence closest to the answer sentence, is
checked against the source like any other, and is marked `attributed` (the model did not write it)."""

from __future__ import annotations

import re

from localmoe.documents.citations import MARKER, Citation, best_sentence, check
from localmoe.documents.records import Chunk
from localmoe.documents.retrieval import tokens

NEW_WORDS = 1  # content words beyond the question's the passage must share with the sentence
SHARE = 0.75  # the share of the sentence's content words the passage must hold
# words that frame an answer rather than state it ("Based on the information provided, ...")
STEM = 6  # letters of a word compared ("approve" and "approved" match)
FRAME = frozenset(w[:STEM] for w in ["based", "according", "document", "information", "provided", "passage",
                                     "text", "states", "stated", "says", "mentioned", "answer", "therefore",
                                     "however", "also"])
# a sentence ends at . ! ? followed by a space, at a blank line, or before a list item on a new line
SENTENCE = re.compile(r".+?(?:[.!?](?=\s)|$|(?=\n\s*\n)|(?=\n\s*(?:[-*\u2022]|\d+[.)])\s))", re.DOTALL)
NUMBERED = re.compile(r"\[(?:\d+|unverified)\]")  # markers check_answer left: [1], [unverified]
CITED_NEXT = re.compile(r"\s*\[(?:\d+|unverified)\]")  # a marker just after a sentence's full stop is its own


def _stems(text: str) -> set[str]:
    """Content words cut to their first `STEM` letters, so "approve" and "approved" are one word."""
    return {w[:STEM] for w in tokens(text)}


def _best(sentence: str, asked: set[str], read: list[Chunk]) -> Chunk | None:
    """The passage of `read` the sentence draws from, or None when none holds enough of it."""
    words = _stems(sentence) - FRAME
    new = words - asked
    if not words & asked or len(new) < NEW_WORDS:  # off the question's topic, or only repeating it
        return None
    best, key = None, (0, 0)
    for chunk in read:
        have = _stems(chunk.text)
        score = (len(words & have), len(new & have))
        if score > key:
            best, key = chunk, score
    if best is None or key[0] < SHARE * len(words) or key[1] < NEW_WORDS:
        return None
    return best


def attribute(text: str, question: str, read: list[Chunk], numbered: int) -> tuple[str, list[Citation]]:
    """`text` (a checked answer) with a citation `[n]` after each unmarked sentence a passage of `read`
    supports; the new citations are numbered from `numbered + 1`. Returns the text and the citations."""
    asked = _stems(question)
    by_id = {c.id: c for c in read}
    found: list[Citation] = []
    numbers: dict[tuple[int, str], int] = {}
    out, last = [], 0
    for match in SENTENCE.finditer(text):
        sentence = match.group(0)
        if CITED_NEXT.match(text, match.end()) or NUMBERED.search(sentence) or MARKER.search(sentence) or not sentence.strip():
            continue
        chunk = _best(sentence, asked, read)
        if chunk is None:
            continue
        cite = check(chunk.id, "", sentence.strip(), by_id)  # most of the sentence's words are in the passage
        if not cite.verified:
            continue
        quote = best_sentence(chunk, sentence)
        if not check(chunk.id, quote, sentence.strip(), by_id).verified:
            quote = ""
        cite.quote, cite.attributed = quote, True
        key = (chunk.id, quote)
        if key not in numbers:
            found.append(cite)
            numbers[key] = numbered + len(found)
        end = match.end()
        stripped = sentence.rstrip()
        end -= len(sentence) - len(stripped)
        out.append(text[last:end] + f" [{numbers[key]}]")
        last = end
    out.append(text[last:])
    return "".join(out), found
