"""Document analysis quality and speed on real public documents.

The documents: the licence texts every Debian system ships in /usr/share/common-licenses
(GPL-3, Apache-2.0, MPL-2.0, LGPL-2.1, GFDL-1.3, Artistic, BSD), each set as a PDF with fpdf2,
so the benchmark needs no network. 32 questions (benchmarks/document_questions.py), each with
words of the answer; a question's pages are the PDF pages whose text holds those words. Printed:
  - retrieval recall@5: share of questions with one of the 5 best BM25 passages on a right page;
  - answer accuracy: share of answers holding the answer's words (case, spacing, quotes folded);
  - citation precision: share of the pages the report cites (its checked citations, or, when the
    answer cites nothing, its uncited evidence) that hold the answer; the model's own checked
    citations and the attributed ones (attached after generation) are also counted apart;
  - seconds per question (load excluded) and the answers' kinds (cited, uncited, not found);
  - ingestion pages/s against a bare pypdf loop on a generated 200-page PDF (ratio);
  - a generated 1,000-page PDF: ingestion time, and the model calls one question costs (bounded).
Run: .venv/bin/python benchmarks/documents.py [--budget low] [--model PATH] [--retrieval-only]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.documents.builders writes the PDF

from common import report
from document_questions import QUESTIONS

LICENCES = Path("/usr/share/common-licenses")


def licence_pdf(text: str, path: Path) -> Path:
    """`text` (a plain-text licence) set as an A5 PDF (a paperback page), paragraph after paragraph, 10 pt."""
    from fpdf import FPDF

    pdf = FPDF(format=(148, 210))  # A5 in mm
    pdf.set_auto_page_break(True, margin=15)
    pdf.add_page()
    pdf.set_font("Helvetica", size=10)
    for paragraph in re.split(r"\n\s*\n", text.expandtabs(4)):
        body = " ".join(paragraph.split()).encode("latin-1", "replace").decode("latin-1")
        if body:
            pdf.multi_cell(0, 5, body, new_x="LMARGIN", new_y="NEXT")
            pdf.ln(2)
    pdf.output(str(path))
    return path


def page_of(location: str) -> int | None:
    match = re.match(r"page (\d+)", location)
    return int(match.group(1)) if match else None


def ingest_throughput(folder: Path) -> None:
    import pypdf

    from localmoe.documents import ingest
    from tests.documents.builders import write_pdf

    pdf = write_pdf(folder / "generated.pdf", pages=200)
    start = time.perf_counter()
    for page in pypdf.PdfReader(str(pdf)).pages:
        page.extract_text()
    bare = time.perf_counter() - start
    start = time.perf_counter()
    pages = ingest([pdf]).pages
    ours = time.perf_counter() - start
    report([("ingest (localmoe), 200-page PDF", f"{pages / ours:8.1f} pages/s"),
            ("pypdf extract_text alone", f"{200 / bare:8.1f} pages/s"),
            ("ratio localmoe / bare pypdf", f"{bare / ours:8.2f}")])


def thousand_pages(folder: Path, asker, budget: str) -> None:
    """A generated 1,000-page PDF with one fact on page 873: ingestion time, then one question through the
    analysis (the model given, or the scripted extractive model with --retrieval-only): its model calls
    against the budget's bound, and the page it cites."""
    from localmoe.documents import analyse, ingest
    from localmoe.documents.analysis import PLANS
    from tests.documents import builders
    from tests.documents.scripted import ExtractiveAsker

    start = time.perf_counter()
    pdf = builders.write_pdf(folder / "thousand.pdf", pages=1000, facts={873: builders.PDF_FACTS[7]})
    written = time.perf_counter() - start
    start = time.perf_counter()
    ingested = ingest([pdf])
    read = time.perf_counter() - start
    asker = asker or ExtractiveAsker(context=8192)
    calls = asker.usage.calls
    start = time.perf_counter()
    result = asyncio.run(analyse(asker, ingested, "Who signed the cobalt procurement review?", budget))
    answered = time.perf_counter() - start
    cited = ",".join(f"{page_of(c.location)}" for c in result.citations or result.evidence) or "-"
    report([("1,000-page PDF: pages / passages", f"{ingested.pages} / {result.stats['chunks']}"),
            ("  written by fpdf2 (not counted)", f"{written:8.1f} s"),
            ("  ingestion", f"{read:8.1f} s ({ingested.pages / read:.0f} pages/s)"),
            ("  model calls (bound for the budget)",
             f"{asker.usage.calls - calls} ({PLANS[budget].calls + 1}), {result.mode}"),
            ("  answer", f"{answered:8.1f} s, {result.status}, cites page {cited} (fact on page 873)")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="low", choices=["low", "high", "max"])
    parser.add_argument("--model", default=None, help="a model path (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--retrieval-only", action="store_true", help="recall@5 only; no model is loaded")
    parser.add_argument("--limit", type=int, default=None, help="ask only the first N questions")
    parser.add_argument("--no-long", action="store_true", help="skip the generated 1,000-page PDF")
    args = parser.parse_args()

    from localmoe.documents import analyse, ingest
    from localmoe.documents.asker import ServiceAsker
    from localmoe.documents.chunks import chunk_documents
    from localmoe.documents.citations import normalize
    from localmoe.documents.retrieval import Index

    questions = QUESTIONS[: args.limit]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ingest_throughput(folder)
        documents = {}
        for name in sorted({q[0] for q in questions}):
            pdf = licence_pdf((LICENCES / name).read_text(encoding="utf-8"), folder / f"{name}.pdf")
            ingested = ingest([pdf])
            pages = {page_of(s.location): normalize(s.text) for s in ingested.documents[0].sections}
            chunks = chunk_documents(ingested.documents)
            documents[name] = (ingested, pages, Index(chunks))
        print(f"{len(questions)} questions over {len(documents)} licences set as PDFs "
              f"({sum(d[0].pages for d in documents.values())} pages)")

        asker = None
        if not args.retrieval_only:
            from localmoe.config import EngineConfig
            from localmoe.load import load_model
            from localmoe.runtime.service import ServerConfig, Service

            start = time.perf_counter()
            loaded = load_model(args.model, EngineConfig(threads=args.threads), progress=False)
            service = Service(loaded, ServerConfig(threads=args.threads))
            service.start()
            asker = ServiceAsker(service, args.budget)
            print(f"model {service.model_id} loaded in {time.perf_counter() - start:.1f} s; "
                  f"context {service.context} tokens; budget {args.budget}")
        found = accurate = 0
        shown = shown_right = own = own_right = added = added_right = 0
        answers_cited = {"own": 0, "attributed": 0}
        kinds: dict[str, int] = {}
        seconds = []
        try:
            for name, question, answer_words in questions:
                ingested, pages, index = documents[name]
                wanted = normalize(answer_words)
                right = {p for p, text in pages.items() if wanted in text}
                if not right:
                    raise SystemExit(f"{name}: {answer_words!r} is on no page of the PDF; fix the question")
                top = {page_of(c.location) for c, _ in index.search(question, 5)}
                found += bool(top & right)
                line = f"{name:10} p{','.join(map(str, sorted(right))):6} recall {'yes' if top & right else 'NO '}"
                if asker is not None:
                    start = time.perf_counter()
                    result = asyncio.run(analyse(asker, ingested, question, args.budget))
                    seconds.append(time.perf_counter() - start)
                    text = normalize(re.sub(r"\[\d+\]|\[unverified\]", "", result.answer))
                    accurate += wanted in text
                    kinds[result.status] = kinds.get(result.status, 0) + 1
                    cited = result.citations or result.evidence
                    shown += len(cited)
                    shown_right += sum(page_of(c.location) in right for c in cited)
                    mine = [c for c in result.citations if not c.attributed]
                    attributed = [c for c in result.citations if c.attributed]
                    own += len(mine)
                    own_right += sum(page_of(c.location) in right for c in mine)
                    added += len(attributed)
                    added_right += sum(page_of(c.location) in right for c in attributed)
                    answers_cited["own"] += bool(mine)
                    answers_cited["attributed"] += bool(attributed) and not mine
                    line += (f"  answer {'yes' if wanted in text else 'no '}  {result.status:9} cites "
                             f"{','.join(str(page_of(c.location)) for c in cited) or '-':8} {seconds[-1]:5.1f} s")
                print(line + f"  {question}")
            if not args.no_long:
                thousand_pages(folder, asker, args.budget)
        finally:
            if asker is not None:
                service.stop()
        n = len(questions)
        with_citation = (f"{answers_cited['own'] + answers_cited['attributed']}/{n} (the model's own "
                         f"{answers_cited['own']}, attributed only {answers_cited['attributed']})")
        rows = [("retrieval recall@5", f"{found / n:.2f} ({found}/{n}; goal 0.90)")]
        if asker is not None:
            rows += [("answer accuracy", f"{accurate / n:.2f} ({accurate}/{n})"),
                     ("citation precision (cited pages)",
                      f"{shown_right / max(shown, 1):.2f} ({shown_right}/{shown}; goal 0.90)"),
                     ("  of the model's own checked citations", f"{own_right}/{own}"),
                     ("  of the attributed citations", f"{added_right}/{added}"),
                     ("answers with a checked citation", with_citation),
                     ("answers", ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))),
                     ("seconds per question", f"{sum(seconds) / n:.1f} (max {max(seconds):.1f})"),
                     ("loops stopped", str(asker.usage.loops))]
        report(rows)


if __name__ == "__main__":
    main()
