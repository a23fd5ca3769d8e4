"""What the model is asked: passages labelled [P<id>] with a short name for their place, and how to cite them.

The label holds the file's base name and the location, each cut to a few words: the full path
stays outside the prompt (the chunk table maps every id back to its file and location), so a
200-character path costs the prompt no more than a short one."""

from __future__ import annotations

from pathlib import PurePath

from localmoe.documents.records import Chunk

CITE_RULE = ('After every claim, cite its passage and copy the exact supporting words from it, like this: '
             '[P3: "exact words from passage 3"]. Use only the passages; if they do not hold the answer, say so.')

ANSWER_SYSTEM = "You answer questions about documents, using only the numbered passages you are given. " + CITE_RULE

MAP_SYSTEM = ("You extract facts from numbered document passages. List only the facts that help answer the "
              "question, one per line, each with its citation. " + CITE_RULE + " If no passage helps, write NONE.")

REDUCE_SYSTEM = ("You write the final answer to a question from notes taken on many document passages. Keep "
                 "every citation [P<id>: \"...\"] exactly as it appears in the notes. " + CITE_RULE)

LABEL_CHARS = 40  # the most characters of a file name, and of a location, a passage label shows


def _short(text: str) -> str:
    return text if len(text) <= LABEL_CHARS else text[:LABEL_CHARS - 3].rstrip() + "..."


def label(chunk: Chunk) -> str:
    """`[P3] report.pdf, page 3`: the id the model cites, then a short reminder of where the passage is."""
    name = _short(PurePath(chunk.source).name or chunk.source)
    return f"[P{chunk.id}] {name}, {_short(chunk.location)}" if chunk.location else f"[P{chunk.id}] {name}"


def passage_block(chunk: Chunk) -> str:
    return f"{label(chunk)}\n{chunk.text}"


def passages_prompt(question: str, chunks: list[Chunk]) -> str:
    return passages_with_pictures(question, chunks)[0]


def passages_with_pictures(question: str, chunks: list[Chunk]) -> tuple[str, list[tuple[int, bytes]]]:
    """The passages prompt and its pictures: (character offset in the prompt, PNG bytes) of each passage that has
    one, placed after its label, before its text."""
    text, pictures = "Passages:\n\n", []
    for k, chunk in enumerate(chunks):
        text += ("\n\n" if k else "") + label(chunk) + "\n"
        if chunk.image is not None:
            pictures.append((len(text), chunk.image))
        text += chunk.text
    return f"{text}\n\nQuestion: {question}", pictures


def reduce_prompt(question: str, notes: list[str]) -> str:
    body = "\n".join(n.strip() for n in notes if n.strip())
    return f"Notes:\n{body}\n\nQuestion: {question}"
