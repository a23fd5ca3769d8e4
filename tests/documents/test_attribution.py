"""Attribution after generation: a sentence the model left uncited is cited to the passage it draws
its words from, checked against it and marked attributed; a sentence that only repeats the question,
strays off it, or holds words no passage holds is never attributed."""

from __future__ import annotations

import asyncio

from localmoe.documents import analyse, check_answer, ingest
from localmoe.documents.attribution import attribute
from localmoe.documents.citations import normalize
from localmoe.documents.records import Chunk
from tests.documents import builders
from tests.documents.scripted import FixedAsker

READ = [Chunk(4, "a.pdf", "page 4", "Invoices are paid within 45 days.\nThe pump failed twice in May."),
        Chunk(9, "a.pdf", "page 9", "The Board approved the new budget on 3 March.\nIt meets every quarter.")]
QUESTION = "When did the board approve the budget?"


def test_uncited_sentence_is_cited_to_the_passage_it_draws_from():
    text, found = attribute("Based on the document, the board approved the new budget on 3 March.", QUESTION, READ, 0)
    (cite,) = found
    assert (cite.passage, cite.location, cite.verified, cite.attributed) == (9, "page 9", True, True)
    assert normalize(cite.quote) in normalize(READ[1].text) and "3 march" in normalize(cite.quote)
    assert text.endswith("3 March. [1]") and cite.label().endswith("(attributed)")


def test_numbering_follows_the_models_own_citations():
    checked = check_answer('Invoices are paid in 45 days [P4: "paid within 45 days"]. The board approved the new '
                           "budget on 3 March.", READ)
    text, found = attribute(checked.text, QUESTION, READ, len(checked.citations))
    assert [c.passage for c in checked.citations] == [4] and [c.passage for c in found] == [9]
    assert text.count("[1]") == 1 and text.endswith("[2]")


def test_no_attribution_without_support():
    for sentence in ["The board approved the budget.",  # only the question's words
                     "The pump failed twice in May.",  # off the question's topic
                     "The board approved the budget on 12 October after a long vote.",  # words no passage holds
                     ""]:
        text, found = attribute(sentence, QUESTION, READ, 0)
        assert found == [] and text == sentence, sentence


def test_uncited_answer_gets_an_attributed_citation_in_the_report(tmp_path):
    pdf = builders.write_pdf(tmp_path / "audit.pdf", pages=6, facts={5: builders.PDF_FACTS[7]})
    asker = FixedAsker("The review was signed by Auditor Priya Ramaswamy on 14 June.")
    report = asyncio.run(analyse(asker, ingest([pdf]), "Who signed the cobalt procurement review?", "low"))
    assert report.status == "cited" and report.rejected == []
    (cite,) = report.citations
    assert (cite.location, cite.attributed) == ("page 5", True) and "Priya Ramaswamy" in cite.quote
    assert report.answer.endswith("[1]") and "(attributed)" in report.to_markdown()
    assert report.to_dict()["citations"][0]["attributed"] is True


def test_a_wrong_answer_stays_uncited(tmp_path):
    pdf = builders.write_pdf(tmp_path / "audit.pdf", pages=6, facts={5: builders.PDF_FACTS[7]})
    asker = FixedAsker("The cobalt procurement review was signed by the harbour master Olufemi Adeyemi in 1987.")
    report = asyncio.run(analyse(asker, ingest([pdf]), "Who signed the cobalt procurement review?", "low"))
    assert report.status == "uncited" and report.citations == []
    assert report.evidence[0].location == "page 5" and "## Uncited evidence" in report.to_markdown()


def test_a_sentence_the_model_cited_is_left_alone():
    checked = check_answer("The board approved the new budget on 3 March. [P9]", READ)
    text, found = attribute(checked.text, QUESTION, READ, len(checked.citations))
    assert len(checked.citations) == 1 and found == [] and text == checked.text
