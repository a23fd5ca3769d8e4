"""Document analysis: ingestion throughput and end-to-end time on a 200-page PDF.

Builds a 200-page PDF (fpdf2, ~120 words a page, one planted fact on page 137), then prints
  - ingestion pages/s of `localmoe.documents.ingest` and of a bare pypdf `extract_text` loop
    over the same file (the floor: what the text layer alone costs), and their ratio;
  - `localmoe analyze`'s end-to-end seconds on the embedded model (load excluded) per budget,
    with the mode it chose (the PDF does not fit SmolLM2's 8K context: map-reduce), the model
    calls, and whether the checked citation names page 137.
Run: .venv/bin/python benchmarks/documents.py [--pages 200] [--budgets low,high] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.documents.builders writes the PDF

from common import report

from tests.documents.builders import PDF_FACTS, write_pdf

FACT_PAGE = 137
QUESTION = "Who signed the cobalt procurement review?"


def bare_pypdf_seconds(path: Path) -> float:
    import pypdf

    start = time.perf_counter()
    for page in pypdf.PdfReader(str(path)).pages:
        page.extract_text()
    return time.perf_counter() - start


def ingest_seconds(path: Path) -> tuple[float, int]:
    from localmoe.documents import ingest

    start = time.perf_counter()
    ingested = ingest([path])
    return time.perf_counter() - start, ingested.pages


async def analyse_once(service, path: Path, budget: str):
    from localmoe.documents import answer

    start = time.perf_counter()
    result = await answer(service, [path], QUESTION, budget)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=200)
    parser.add_argument("--budgets", default="low,high")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        pdf = write_pdf(Path(tmp) / "report.pdf", pages=args.pages, facts={FACT_PAGE: PDF_FACTS[7]})
        print(f"{args.pages}-page PDF, {pdf.stat().st_size / 2**20:.1f} MiB, fact on page {FACT_PAGE}")
        bare = min(bare_pypdf_seconds(pdf) for _ in range(2))
        ours, pages = min(ingest_seconds(pdf) for _ in range(2))
        report([("ingest (localmoe)", f"{pages / ours:8.1f} pages/s  ({ours:.2f} s, {pages} pages)"),
                ("pypdf extract_text alone", f"{args.pages / bare:8.1f} pages/s  ({bare:.2f} s)"),
                ("ratio localmoe / bare pypdf", f"{bare / ours:8.2f}")])

        from localmoe.config import EngineConfig
        from localmoe.load import load_model
        from localmoe.server.service import ServerConfig, Service

        start = time.perf_counter()
        loaded = load_model(None, EngineConfig(threads=args.threads), progress=False)
        service = Service(loaded, ServerConfig(threads=args.threads))
        service.start()
        print(f"embedded model loaded in {time.perf_counter() - start:.1f} s; context {service.context} tokens")
        try:
            for budget in args.budgets.split(","):
                seconds, result = asyncio.run(analyse_once(service, pdf, budget))
                stats = result.stats
                cited = {c.location for c in result.citations if c.verified} | {e.location for e in result.evidence}
                report([(f"analyze --budget {budget}", (f"{seconds:8.1f} s end to end ({result.mode}, "
                                                      f"{stats['model_calls']} model calls, "
                                                      f"{stats['passages_read']} of {stats['chunks']} passages, "
                                                      f"{stats.get('prompt_tokens', 0)} prompt + "
                                                      f"{stats.get('completion_tokens', 0)} generated tokens)")),
                        ("  cites the fact's page", str(f"page {FACT_PAGE}" in cited))])
        finally:
            service.stop()


if __name__ == "__main__":
    main()
