"""Citations are checked against the passage they name: right quotes are kept with their file
and page, wrong ones are rejected and flagged, and analysis reports cite the planted page."""

from __future__ import annotations

import asyncio

from localmoe.documents import analyse, check_answer, ingest
from localmoe.documents.chunks import chunk_documents
from localmoe.documents.records import Chunk
from tests.documents import builders
from tests.documents.scripted import ExtractiveAsker, FixedAsker

CHUNKS = [Chunk(1, "a.pdf", "page 1", "The pump failed twice in May.\nRepairs cost 4,100 euros."),
          Chunk(2, "a.pdf", "page 2", "The Board approved the new\nbudget on 3 March."),
          Chunk(3, "b.xlsx", "sheet Costs, rows 1-3", "item | cost\npump | 4100")]


def test_right_quote_kept_with_file_and_page():
    checked = check_answer('The board approved the budget [P2: "the Board approved the new budget"].', CHUNKS)
    (cite,) = checked.citations
    assert (cite.source, cite.location, cite.verified) == ("a.pdf", "page 2", True)
    assert checked.rejected == [] and checked.text.endswith("[1].")


def test_wrong_quote_rejected_and_flagged():
    checked = check_answer('Repairs cost 9,000 euros [P1: "Repairs cost 9,000 euros"].', CHUNKS)
    assert checked.citations == []
    (bad,) = checked.rejected
    assert not bad.verified and "not in P1" in bad.reason and "in no passage" in bad.reason
    assert "[unverified]" in checked.text and "[P1" not in checked.text


def test_quote_from_another_passage_is_rejected_and_located():
    checked = check_answer('It was approved [P1: "approved the new budget on 3 March"].', CHUNKS)
    (bad,) = checked.rejected
    assert "it is in P2" in bad.reason


def test_unknown_passage_and_too_short_quote():
    checked = check_answer('Claim one [P9: "pump failed twice"]. Claim two [P1: "pump"].', CHUNKS)
    reasons = [c.reason for c in checked.rejected]
    assert "no passage P9" in reasons[0] and "too short" in reasons[1]


def test_unquoted_citation_needs_the_claim_in_the_passage():
    checked = check_answer("The pump failed twice in May [P1]. Tigers roam the steppe [P1].", CHUNKS)
    assert [c.location for c in checked.citations] == ["page 1"]
    assert len(checked.rejected) == 1 and "claim's words" in checked.rejected[0].reason


def test_list_of_ids_and_repeats_share_numbers():
    checked = check_answer('Pump cost [P1: "repairs cost 4,100 euros"] and [P1: "Repairs cost 4,100 euros"]. '
                           "The pump cost 4100 [P3, P1].", CHUNKS)
    # the quoted P1 twice is one source; [P3, P1] are two more (P1 unquoted is another citation of page 1)
    assert [(c.passage, bool(c.quote)) for c in checked.citations] == [(1, True), (3, False), (1, False)]
    assert [checked.text.count(f"[{n}]") for n in (1, 2, 3)] == [2, 1, 1]


def test_report_cites_the_planted_page(tmp_path):
    pdf = builders.write_pdf(tmp_path / "plant.pdf", pages=8)
    ingested = ingest([tmp_path])
    asker = ExtractiveAsker()
    report = asyncio.run(analyse(asker, ingested, "Who signed the cobalt procurement review?", "low"))
    assert report.mode == "long-context" and len(asker.prompts) == 1
    (cite,) = report.citations
    assert (cite.source, cite.location) == (pdf.name, "page 7")
    assert "Priya Ramaswamy" in cite.quote
    assert report.evidence[0].location == "page 7"
    markdown = report.to_markdown()
    assert f'1. {pdf.name}, page 7: "' in markdown
    assert report.to_dict()["citations"][0]["location"] == "page 7"


def test_map_reduce_when_documents_exceed_the_context(tmp_path):
    # many pages mention the turbine plant; only page 41 says what it produced
    facts = {p: f"The turbine plant crew met in week {p}." for p in range(1, 61)}
    facts[41] = builders.PDF_FACTS[3]
    builders.write_pdf(tmp_path / "long.pdf", pages=60, facts=facts, words_per_page=200)
    ingested = ingest([tmp_path])
    chunks = chunk_documents(ingested.documents)
    total = sum(len(c.text.split()) for c in chunks)
    asker = ExtractiveAsker(context=1200)  # a tenth of the material fits
    assert total > 5 * asker.context
    report = asyncio.run(analyse(asker, ingested, "How many megawatt hours did the Zanzibar turbine plant produce?",
                                 "high"))
    assert report.mode == "map-reduce"
    assert len(asker.prompts) == report.stats["model_calls"] > 2  # several notes, then the answer
    assert asker.prompts[-1][1].startswith("Notes:")
    # each group's note cites its best sentence; the one with the answer cites page 41, and all notes check out
    located = {c.location: c for c in report.citations}
    assert "4,812 megawatt hours" in located["page 41"].quote
    assert report.rejected == [] and all(c.source == "long.pdf" for c in report.citations)


def test_scripted_wrong_quote_never_reaches_the_sources(tmp_path):
    builders.write_pdf(tmp_path / "plant.pdf", pages=8)
    ingested = ingest([tmp_path])
    chunk_of_page_7 = next(c for c in chunk_documents(ingested.documents) if c.location == "page 7")
    asker = FixedAsker(f'Bob Smith signed it [P{chunk_of_page_7.id}: "Auditor Bob Smith signed"].')
    report = asyncio.run(analyse(asker, ingested, "Who signed the cobalt procurement review?", "low"))
    assert report.citations == [] and len(report.rejected) == 1
    assert "[unverified]" in report.answer
    markdown = report.to_markdown()
    sources = markdown.split("## Sources")[1] if "## Sources" in markdown else ""
    assert "Bob Smith" not in sources and "## Rejected citations" in markdown


def test_evidence_quote_checks_across_dash_rules_and_hyphenated_breaks():
    """A passage with a line of dashes and a word broken by a hyphen at a line end still yields a checked quote."""
    from localmoe.documents.citations import evidence

    chunk = Chunk(1, "mpl.pdf", "page 8", "Exhibit A - Notice\n---------\nThis form is subject to the Mozilla procure-\n"
                                           "ment steward rules.")
    (quote,) = evidence([chunk], "Who is the Mozilla procurement steward?", [chunk])
    assert quote.verified and "procurement steward" in quote.quote
