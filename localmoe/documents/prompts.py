"""What the model is asked: passages numbered [P<id>] with their file and location, and how to cite them."""

from __future__ import annotations

from localmoe.documents.records import Chunk

CITE_RULE = ('After every claim, cite its passage and copy the exact supporting words from it, like this: '
             '[P3: "exact words from passage 3"]. Use only the passages; if they do not hold the answer, say so.')

ANSWER_SYSTEM = "You answer questions about documents, using only the numbered passages you are given. " + CITE_RULE

MAP_SYSTEM = ("You extract facts from numbered document passages. List only the facts that help answer the "
              "question, one per line, each with its citation. " + CITE_RULE + " If no passage helps, write NONE.")

REDUCE_SYSTEM = ("You write the final answer to a question from notes taken on many document passages. Keep "
                 "every citation [P<id>: \"...\"] exactly as it appears in the notes. " + CITE_RULE)


def passage_block(chunk: Chunk) -> str:
    return f"[P{chunk.id}] {chunk.where}\n{chunk.text}"


def passages_prompt(question: str, chunks: list[Chunk]) -> str:
    body = "\n\n".join(passage_block(c) for c in chunks)
    return f"Passages:\n\n{body}\n\nQuestion: {question}"


def reduce_prompt(question: str, notes: list[str]) -> str:
    body = "\n".join(n.strip() for n in notes if n.strip())
    return f"Notes:\n{body}\n\nQuestion: {question}"
