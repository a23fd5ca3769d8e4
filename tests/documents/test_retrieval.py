"""BM25 ranks the passage holding a planted fact first for the question about it."""

from __future__ import annotations

import pytest

from localmoe.documents import search_documents
from localmoe.documents.retrieval import tokens
from tests.documents import builders

QUESTIONS = [
    ("How many megawatt hours did the Zanzibar turbine plant produce?", "plant-report.pdf", "page 3"),
    ("Who signed the cobalt procurement review?", "plant-report.pdf", "page 7"),
    ("How long does the warranty for the Hollis gearbox last?", "handbook.docx", "paragraphs"),
    ("What amount is booked for Quokka Logistics?", "ledger.xlsx", f"sheet {builders.XLSX_FACT[0]}"),
    ("When is the launch of the Marigold satellite?", "update.pptx", f"slide {builders.PPTX_FACT[0]}"),
    ("Which day does the Brindle library open its rare maps room?", "services.html", 'section "Library"'),
]


@pytest.mark.parametrize(("question", "source", "location"), QUESTIONS, ids=[q[1] + ":" + q[2] for q in QUESTIONS])
def test_planted_passage_ranks_first(corpus, question, source, location):
    folder, _ = corpus
    passages = search_documents(question, [folder], top_k=3)
    assert passages, "no hit at all"
    best = passages[0]
    assert best.source == source and best.location.startswith(location)
    assert all(best.score >= p.score for p in passages)


def test_question_of_unknown_words_finds_nothing(corpus):
    folder, _ = corpus
    assert search_documents("xylophone quasar", [folder]) == []


def test_tokens_drop_stopwords_and_split_numbers():
    assert tokens("What was the 12.5% Rise?") == ["12", "5", "rise"]
