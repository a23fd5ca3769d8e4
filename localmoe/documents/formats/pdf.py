"""PDF: the text layer of each page, numbered from 1 (pypdf); pages that hold a picture (a figure, a chart) or
little extractable text (a scan) are also rendered to a PNG (pypdfium2), which a model with a vision tower reads
beside the page's text (documents/analysis.py)."""

from __future__ import annotations

import io
from pathlib import Path

from localmoe.documents.formats.base import Parsed, UnreadableFile
from localmoe.documents.records import PICTURE_NOTE, Section

MIN_PAGE_TEXT = 200  # characters: a page with less extractable text is rendered too (a scan, a chart page)
RENDER_SIDE = 1024  # pixels on the longer side of a rendered page (the towers scale larger images down anyway)


def _has_picture(page) -> bool:
    """Whether the page draws an image XObject (a figure, a chart, a scan); False when that cannot be told."""
    try:
        xobjects = page["/Resources"].get_object().get("/XObject")
        return xobjects is not None and any(x.get_object().get("/Subtype") == "/Image"
                                            for x in xobjects.get_object().values())
    except Exception:  # noqa: BLE001 (a malformed resource dictionary: judge by the text alone)
        return False


def render_pages(path: Path, numbers: list[int]) -> dict[int, bytes]:
    """PNG bytes of pages `numbers` (1-based), the longer side RENDER_SIDE pixels."""
    import pypdfium2

    out = {}
    pdf = pypdfium2.PdfDocument(str(path))
    try:
        for number in numbers:
            page = pdf[number - 1]
            width, height = page.get_size()  # points
            image = page.render(scale=RENDER_SIDE / max(width, height, 1.0)).to_pil()
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            out[number] = buf.getvalue()
            page.close()
    finally:
        pdf.close()
    return out


def read_pdf(path: Path) -> Parsed:
    import pypdf
    from pypdf.errors import PdfReadError

    try:
        reader = pypdf.PdfReader(str(path))
        if reader.is_encrypted and not reader.decrypt(""):
            raise UnreadableFile("encrypted PDF that needs a password; decrypt it first "
                                 "(e.g. qpdf --password=... --decrypt in.pdf out.pdf)")
        pages = list(reader.pages)
    except UnreadableFile:
        raise
    except (PdfReadError, ValueError, KeyError, TypeError, OSError) as e:
        raise UnreadableFile(f"not a readable PDF ({type(e).__name__}: {e}); re-export or repair it") from None
    except Exception as e:  # noqa: BLE001 (e.g. pypdf's missing-dependency error for AES without `cryptography`)
        raise UnreadableFile(f"cannot open this PDF ({type(e).__name__}: {e})") from None
    texts, problems = {}, []
    for number, page in enumerate(pages, start=1):
        try:
            texts[number] = page.extract_text() or ""
        except Exception as e:  # noqa: BLE001 (one bad page must not lose the others)
            problems.append(f"page {number}: text could not be extracted ({type(e).__name__}: {e})")
            continue
        if not texts[number].strip():
            problems.append(f"page {number} has no text layer (a scanned image?): a model with a vision tower reads "
                            "its picture; for a text model run OCR on it (e.g. ocrmypdf)")
    wanted = [n for n, text in texts.items() if len(text.strip()) < MIN_PAGE_TEXT or _has_picture(pages[n - 1])]
    try:
        pictures = render_pages(path, wanted) if wanted else {}
    except Exception as e:  # noqa: BLE001 (the text stays usable when rendering fails)
        pictures = {}
        problems.append(f"pages {', '.join(map(str, wanted))} could not be rendered to pictures "
                        f"({type(e).__name__}: {e}); their text is read alone")
    sections = [Section(f"page {n}", text if text.strip() else PICTURE_NOTE, image=pictures.get(n))
                for n, text in texts.items() if text.strip() or n in pictures]
    return Parsed("pdf", sections, pages=len(pages), problems=problems)
