"""Prompts sized from real token counts: with the embedded model's tokenizer, chat template and
8K context, no path length, document length, file count or budget makes a prompt overflow; the
number of model calls stays bounded; every answer has checked citations or labelled uncited
evidence; a question nothing matches is "not found"; loops are cut."""

from __future__ import annotations

import asyncio

import pytest

from localmoe.documents import analyse, ingest
from localmoe.documents.analysis import PLANS
from localmoe.documents.repetition import collapse_repeats, loop_at
from tests.documents import builders
from tests.documents.scripted import ExtractiveAsker, FixedAsker, TemplateAsker

QUESTION = "Who signed the cobalt procurement review?"


def _deep(tmp_path, length: int = 200):
    """A folder whose absolute path is about `length` characters long."""
    folder = tmp_path
    while len(str(folder)) < length - 30:
        folder = folder / "quarterly-reports-and-audits"
    folder.mkdir(parents=True)
    return folder


def _answers_with_sources(report) -> None:
    assert report.status in ("cited", "uncited"), report.status
    assert report.citations or report.evidence  # citations, or the evidence labelled uncited
    markdown = report.to_markdown()
    if report.status == "uncited":
        assert "## Uncited evidence" in markdown
    else:
        assert "## Sources" in markdown


@pytest.fixture(scope="module")
def long_pdf(tmp_path_factory):
    """A 300-page PDF at a 200-character absolute path; the fact on page 237."""
    folder = _deep(tmp_path_factory.mktemp("long"))
    name = "annual-report-of-the-procurement-and-audit-committee-" + "x" * 40 + ".pdf"
    return builders.write_pdf(folder / name, pages=300, facts={237: builders.PDF_FACTS[7]})


@pytest.mark.parametrize("budget", ["low", "high", "max"])
def test_300_pages_at_a_200_character_path_never_overflow(service, long_pdf, budget):
    assert len(str(long_pdf)) >= 200 and long_pdf.is_absolute()
    ingested = ingest([long_pdf])
    assert ingested.pages == 300
    asker = TemplateAsker(service)  # refuses any prompt the 8K service would refuse
    report = asyncio.run(analyse(asker, ingested, QUESTION, budget))
    assert report.mode == "map-reduce" and asker.peak <= service.context
    assert len(asker.prompts) == report.stats["model_calls"] <= PLANS[budget].calls + 1
    assert (report.citations[0].source, report.citations[0].location) == (str(long_pdf), "page 237")
    assert str(long_pdf) not in "".join(user for _, user in asker.prompts)  # labels carry no path
    assert report.passages and all(src == str(long_pdf) for src, _ in report.passages.values())
    _answers_with_sources(report)


def test_small_context_still_fits(service, long_pdf):
    """A 2K context: fewer passages per call, still bounded calls and no overflow."""
    asker = TemplateAsker(service, context=2048)
    report = asyncio.run(analyse(asker, ingest([long_pdf]), QUESTION, "max"))
    assert asker.peak <= 2048 and len(asker.prompts) <= PLANS["max"].calls + 1
    assert report.citations[0].location == "page 237"


def test_folder_of_20_mixed_files_at_a_long_path(service, tmp_path):
    folder = _deep(tmp_path)
    written = builders.write_mixed_folder(folder, 20)
    kinds = {p.suffix for p in written.values()}
    assert len(written) == 20 and {".pdf", ".docx", ".pptx", ".xlsx", ".html", ".md", ".py", ".csv"} <= kinds
    ingested = ingest([folder])
    assert len(ingested.documents) == 20 and not ingested.problems
    for question, source, location in [
            ("How long does the warranty for the Hollis gearbox last?", "handbook.docx", "paragraph"),
            ("How many tonnes does quarry crane number 11 lift?", "extra-11-py-module.py", "line"),
            ("When was the launch of the Marigold satellite moved to?", "update.pptx", "slide 2")]:
        asker = TemplateAsker(service)
        report = asyncio.run(analyse(asker, ingested, question, "high"))
        assert asker.peak <= service.context
        assert report.citations[0].source == source and location in report.citations[0].location, question
        _answers_with_sources(report)


def test_uncited_answer_comes_with_labelled_evidence(tmp_path):
    builders.write_pdf(tmp_path / "plant.pdf", pages=8)
    report = asyncio.run(analyse(FixedAsker("Somebody signed it."), ingest([tmp_path]), QUESTION, "low"))
    assert report.status == "uncited" and report.citations == []
    assert report.evidence[0].location == "page 7" and "Priya Ramaswamy" in report.evidence[0].quote
    assert report.to_dict()["status"] == "uncited"
    _answers_with_sources(report)


def test_question_nothing_matches_is_not_found_without_a_model_call(tmp_path):
    builders.write_pdf(tmp_path / "plant.pdf", pages=8)
    asker = FixedAsker("should not be asked")
    report = asyncio.run(analyse(asker, ingest([tmp_path]), "What colour is the giraffe's tongue?", "high"))
    assert report.status == "not_found" and asker.prompts == []
    assert report.answer.startswith("Not found in the documents") and "giraffe" in report.answer


def test_whole_document_question_is_answered_not_refused(tmp_path):
    builders.write_pdf(tmp_path / "plant.pdf", pages=8)
    asker = FixedAsker("It is a set of committee minutes.")
    report = asyncio.run(analyse(asker, ingest([tmp_path]), "Summarize the document.", "low"))
    assert report.status == "uncited" and len(asker.prompts) == 1 and report.evidence


def test_loops_are_found_and_collapsed():
    looping = "The type is inode/directory. " + "See the spec for details. " * 5
    cut = loop_at(looping)
    assert cut is not None and looping[:cut].count("See the spec") < 5
    assert collapse_repeats(looping[:cut]) == "The type is inode/directory. See the spec for details."
    lines = "Answer: 42.\nA line that goes on.\nx\nA line that goes on.\nA line that goes on."
    assert loop_at(lines) is not None and collapse_repeats(lines).count("A line that goes on.") == 1
    assert loop_at("No loop: one two three four five six seven eight.") is None


def test_search_documents_tool_says_not_found_or_gives_located_passages(tmp_path):
    """The TUI / web app's search_documents tool: located passages, or "not found in the documents"."""
    from localmoe.ui.tools import ToolRunner

    from localmoe.chat.format import ToolCall

    pdf = builders.write_pdf(_deep(tmp_path) / "plant-report.pdf", pages=8)
    runner = ToolRunner(tmp_path, document_paths=[pdf])
    found = runner.run(ToolCall("search_documents", {"query": QUESTION}))
    assert found.startswith(f"[{pdf}, page 7]") and "Priya Ramaswamy" in found
    missing = runner.run(ToolCall("search_documents", {"query": "giraffe tongue colour"}))
    from localmoe.documents.retrieval import NOT_FOUND

    assert missing == NOT_FOUND.format(words="colour, giraffe, tongue")  # analyze's and the search route's words


def test_web_sources_panel_labels_uncited_evidence_and_not_found(tmp_path):
    pytest.importorskip("gradio", reason="the web app needs the ui extra")
    from localmoe.ui.web.documents import sources_markdown

    builders.write_pdf(tmp_path / "plant.pdf", pages=8)
    ingested = ingest([tmp_path])
    uncited = asyncio.run(analyse(FixedAsker("Somebody signed it."), ingested, QUESTION, "low"))
    panel = sources_markdown(uncited)
    assert "**Uncited evidence**" in panel and "**plant.pdf**, page 7" in panel
    cited = asyncio.run(analyse(ExtractiveAsker(), ingested, QUESTION, "low"))
    assert sources_markdown(cited).startswith("1. **plant.pdf**, page 7") and "Uncited" not in sources_markdown(cited)
    nothing = asyncio.run(analyse(FixedAsker("x"), ingested, "What colour is the giraffe's tongue?", "low"))
    assert "Not found in the documents" in sources_markdown(nothing)


def test_service_asker_cancels_a_looping_stream():
    """ServiceAsker reads the streamed answer, cancels the generation once it loops, keeps one copy."""
    from localmoe.chat.format import Delta
    from localmoe.documents.asker import ServiceAsker

    class LoopingStream:
        prompt = [1] * 40
        cancelled = False
        sent = 0

        async def events(self):
            for piece in ["The steward is the Mozilla Foundation.\n"] + ["See section 10.\n"] * 50:
                if self.cancelled:
                    return
                self.sent += 1
                yield "delta", Delta("content", piece)

        def cancel(self):
            self.cancelled = True

    stream = LoopingStream()

    class Service:
        async def chat(self, request):
            assert request.params.repetition_penalty > 1
            return stream

        class tokenizer:
            @staticmethod
            def encode(text, add_special_tokens=False):
                return text.split()

    asker = ServiceAsker(Service(), "low")
    text = asyncio.run(asker.ask("system", "user", 500))
    assert stream.cancelled and stream.sent < 10 and asker.usage.loops == 1
    assert text == "The steward is the Mozilla Foundation.\nSee section 10."
