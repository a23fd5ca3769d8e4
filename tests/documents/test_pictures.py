"""PDF pages with charts or no text: rendered to pictures, shown to a model with a vision tower (the tiny Kimi K2.5
proves the plumbing: the chart page's own rendering reaches the tower and the page is among the passages read), left
out for a text model, and a citation of the picture's page is kept and points at that page."""

from __future__ import annotations

import asyncio
import hashlib
import io
import random

import pytest
from PIL import Image, ImageDraw

from localmoe.documents.analysis import answer, with_pictures
from localmoe.documents.chunks import chunk_documents
from localmoe.documents.citations import check_answer
from localmoe.documents.formats.pdf import render_pages
from localmoe.documents.ingest import ingest
from localmoe.documents.records import PICTURE_NOTE
from tests.documents.builders import filler_words


def chart_png() -> bytes:
    """A bar chart whose only statement of the answer is its pixels: the Q3 bar is the tallest, labelled 42."""
    image = Image.new("RGB", (480, 320), "white")
    draw = ImageDraw.Draw(image)
    for k, (quarter, value) in enumerate((("Q1", 12), ("Q2", 20), ("Q3", 42), ("Q4", 17))):
        x = 40 + k * 110
        draw.rectangle((x, 300 - value * 6, x + 70, 300), fill=(30, 90, 200))
        draw.text((x + 25, 305), quarter, fill="black")
        draw.text((x + 25, 285 - value * 6), str(value), fill="black")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def write_chart_pdf(path, tmp_path):
    """Page 1: prose that never states the figure; page 2: the chart alone (no text layer)."""
    from fpdf import FPDF

    chart = tmp_path / "chart.png"
    chart.write_bytes(chart_png())
    pdf = FPDF()
    pdf.add_page()
    pdf.set_font("Helvetica", size=10)
    pdf.multi_cell(180, 5, "Quarterly revenue report. The chart on the next page shows revenue by quarter. "
                   + filler_words(random.Random(0), 80))
    pdf.add_page()
    pdf.image(str(chart), x=20, y=30, w=170)
    pdf.output(str(path))
    return path


@pytest.fixture(scope="module")
def vision_service(tmp_path_factory):
    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.runtime.service import ServerConfig, Service
    from localmoe.testing import write_checkpoint

    loaded = load_model(write_checkpoint("kimi_k25", tmp_path_factory.mktemp("k25"), "tiny", seed=0),
                        EngineConfig(threads=1, max_context=2048), progress=False)
    service = Service(loaded, ServerConfig(sessions_path=None))
    service.start()
    yield service
    service.stop()


def test_the_chart_page_reaches_the_tower(vision_service, tmp_path):
    pdf = write_chart_pdf(tmp_path / "revenue.pdf", tmp_path)
    (document,) = ingest([pdf]).documents
    page2 = next(s for s in document.sections if s.location == "page 2")
    assert page2.text == PICTURE_NOTE and page2.image == render_pages(pdf, [2])[2]
    assert document.sections[0].image is None  # a page of prose holds no picture
    encoder = vision_service.loaded.image_encoder
    before = encoder.encoded
    report = asyncio.run(answer(vision_service, [pdf], "What was the revenue in Q3?", "low"))
    assert (str(pdf), "page 2") in report.passages.values()
    assert hashlib.sha256(page2.image).hexdigest() in encoder.cache  # the page's own rendering was encoded
    assert encoder.encoded == before + 1


def test_a_text_model_reads_the_text_alone(tmp_path):
    pdf = write_chart_pdf(tmp_path / "revenue.pdf", tmp_path)
    chunks = chunk_documents(ingest([pdf]).documents)
    assert [c.location for c in chunks if c.image is not None] == ["page 2"]
    text_only = with_pictures(chunks, sees=False)
    assert [c.location for c in text_only] == ["page 1"] and all(c.image is None for c in text_only)
    assert with_pictures(chunks, sees=True) == chunks


def test_a_citation_of_the_picture_page_is_kept_and_points_at_it(tmp_path):
    pdf = write_chart_pdf(tmp_path / "revenue.pdf", tmp_path)
    chunks = chunk_documents(ingest([pdf]).documents)
    picture = next(c for c in chunks if c.image is not None)
    prose = next(c for c in chunks if c.image is None)
    checked = check_answer(f"Revenue peaked in Q3 at 42 [P{picture.id}: \"Q3 bar labelled 42\"]. "
                           f"The figure was 42 [P{prose.id}: \"Q3 was 42\"].", chunks)
    (cite,) = checked.citations
    assert cite.picture and cite.location == "page 2" and cite.source == str(pdf) and cite.quote == ""
    assert "(the page's picture)" in cite.label()
    assert len(checked.rejected) == 1 and checked.rejected[0].location == "page 1"  # text is still checked
