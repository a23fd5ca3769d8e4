"""Real document files with facts planted at known pages, sheets and slides, written with the
same libraries people's files come from (fpdf2, python-docx, python-pptx, openpyxl)."""

from __future__ import annotations

import random
from pathlib import Path

FILLER = ("The committee reviewed routine matters of procedure and scheduling. Members discussed the calendar, "
          "the minutes of the previous meeting and several items of correspondence. No decisions were taken on "
          "these items and they were carried over to the next session.")

# (page, sentence): what test_ingest and test_retrieval look for
PDF_FACTS = {
    3: "The Zanzibar turbine plant produced 4,812 megawatt hours in March.",
    7: "Auditor Priya Ramaswamy signed the cobalt procurement review on 14 June.",
}
DOCX_FACT = "The warranty for the Hollis gearbox lasts exactly 37 months."
XLSX_FACT = ("Revenue", "Quokka Logistics", 918273)  # sheet, customer, amount
PPTX_FACT = (2, "Launch of the Marigold satellite moved to October.")
HTML_FACT = "The Brindle library opens its rare maps room every Thursday."


def filler_words(rng: random.Random, n: int) -> str:
    words = FILLER.replace(".", "").split()
    return " ".join(rng.choice(words) for _ in range(n)) + "."


def write_pdf(path: Path, pages: int = 8, facts: dict[int, str] | None = None, blank_pages: tuple[int, ...] = (),
              seed: int = 0, words_per_page: int = 120) -> Path:
    """A PDF of `pages` pages of filler, `facts[n]` written on page n, `blank_pages` with an image-like drawing
    and no text layer."""
    from fpdf import FPDF

    facts = PDF_FACTS if facts is None else facts
    rng = random.Random(seed)
    pdf = FPDF()
    pdf.set_auto_page_break(False)
    for number in range(1, pages + 1):
        pdf.add_page()
        if number in blank_pages:
            pdf.set_fill_color(90, 90, 90)
            pdf.rect(20, 20, 170, 240, style="F")  # a "scan": ink but no text
            continue
        pdf.set_font("Helvetica", size=10)
        pdf.set_xy(15, 15)
        body = filler_words(rng, words_per_page // 2)
        if number in facts:
            body += " " + facts[number]
        body += " " + filler_words(rng, words_per_page // 2)
        pdf.multi_cell(180, 5, body)
    pdf.output(str(path))
    return path


def write_encrypted_pdf(path: Path, source: Path) -> Path:
    import pypdf

    writer = pypdf.PdfWriter(clone_from=str(source))
    writer.encrypt(user_password="hunter2", owner_password="owner", algorithm="RC4-128")
    with open(path, "wb") as f:
        writer.write(f)
    return path


def write_docx(path: Path) -> Path:
    import docx

    document = docx.Document()
    document.add_heading("Maintenance handbook", level=1)
    document.add_paragraph(FILLER)
    document.add_paragraph(DOCX_FACT)
    table = document.add_table(rows=2, cols=2)
    table.cell(0, 0).text, table.cell(0, 1).text = "part", "interval"
    table.cell(1, 0).text, table.cell(1, 1).text = "bearing", "6 months"
    document.save(str(path))
    return path


def write_xlsx(path: Path) -> Path:
    import openpyxl

    book = openpyxl.Workbook()
    summary = book.active
    summary.title = "Summary"
    summary.append(["quarter", "note"])
    summary.append(["Q1", "steady"])
    sheet_name, customer, amount = XLSX_FACT
    sheet = book.create_sheet(sheet_name)
    sheet.append(["customer", "amount", "region"])
    for i in range(30):
        sheet.append([f"Customer {i}", 1000 + i, "north"])
    sheet.append([customer, amount, "south"])
    book.save(str(path))
    return path


def write_pptx(path: Path) -> Path:
    import pptx

    deck = pptx.Presentation()
    layout = deck.slide_layouts[1]
    for number in (1, 2, 3):
        slide = deck.slides.add_slide(layout)
        slide.shapes.title.text = f"Programme update {number}"
        text = PPTX_FACT[1] if number == PPTX_FACT[0] else "Schedules are unchanged."
        slide.placeholders[1].text = text
    deck.save(str(path))
    return path


def write_html(path: Path) -> Path:
    path.write_text(f"""<!doctype html><html><head><title>Town services</title><style>p {{color: red}}</style>
<script>var hidden = "do not index";</script></head><body>
<h1>Opening hours</h1><p>{FILLER}</p>
<h2>Library</h2><p>{HTML_FACT}</p>
<table><tr><th>day</th><th>hours</th></tr><tr><td>Monday</td><td>9-17</td></tr></table>
</body></html>""", encoding="utf-8")
    return path


def write_corpus(folder: Path) -> dict[str, Path]:
    """One file of each kind (with their planted facts) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    return {"pdf": write_pdf(folder / "plant-report.pdf"), "docx": write_docx(folder / "handbook.docx"),
            "xlsx": write_xlsx(folder / "ledger.xlsx"), "pptx": write_pptx(folder / "update.pptx"),
            "html": write_html(folder / "services.html")}


def write_mixed_folder(folder: Path, count: int = 20) -> dict[str, Path]:
    """`count` files of every kind (PDF, DOCX, PPTX, XLSX, HTML, Markdown, CSV, text, Python) in `folder`:
    the corpus's five with their facts, then more of each kind with filler and their own facts."""
    written = write_corpus(folder)
    rng = random.Random(7)
    n = len(written)
    while n < count:
        kind = ("md", "py", "csv", "txt", "pdf")[n % 5]
        path = folder / f"extra-{n:02d}-{kind}-{'notes' if kind != 'py' else 'module'}.{kind}"
        fact = f"Extra fact {n}: the quarry crane number {n} lifts {n * 7} tonnes."
        if kind == "md":
            path.write_text(f"# Notes {n}\n\n{filler_words(rng, 80)}\n\n## Crane\n\n{fact}\n", encoding="utf-8")
        elif kind == "py":
            path.write_text(f'"""Module {n}."""\n\n\ndef crane_{n}():\n    """{fact}"""\n    return {n * 7}\n',
                            encoding="utf-8")
        elif kind == "csv":
            path.write_text(f"crane,tonnes\n{n},{n * 7}\nother,{n}\n", encoding="utf-8")
        elif kind == "txt":
            path.write_text(f"{filler_words(rng, 60)}\n{fact}\n{filler_words(rng, 60)}\n", encoding="utf-8")
        else:
            write_pdf(path, pages=3, facts={2: fact}, seed=n)
        written[path.name] = path
        n += 1
    return written
