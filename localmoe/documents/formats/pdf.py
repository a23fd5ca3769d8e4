"""PDF: the text layer of each page, numbered from 1 (pypdf)."""

from __future__ import annotations

from pathlib import Path

from localmoe.documents.formats.base import Parsed, UnreadableFile
from localmoe.documents.records import Section


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
    sections, problems = [], []
    for number, page in enumerate(pages, start=1):
        try:
            text = page.extract_text() or ""
        except Exception as e:  # noqa: BLE001 (one bad page must not lose the others)
            problems.append(f"page {number}: text could not be extracted ({type(e).__name__}: {e})")
            continue
        if not text.strip():
            problems.append(f"page {number} has no text layer (a scanned image?); run OCR on it "
                            "(e.g. ocrmypdf) to include it")
            continue
        sections.append(Section(f"page {number}", text))
    return Parsed("pdf", sections, pages=len(pages), problems=problems)
