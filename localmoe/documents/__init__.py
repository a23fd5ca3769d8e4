"""Offline document analysis: ingest PDFs, office files, HTML, text and code; rank passages
with BM25; answer questions with checked page/sheet/slide/line citations (docs/documents.md)."""

from localmoe.documents.analysis import analyse, answer
from localmoe.documents.citations import Citation, check_answer
from localmoe.documents.ingest import collect_files, ingest
from localmoe.documents.records import Chunk, Document, FileProblem, Ingested, Passage, Section
from localmoe.documents.report import Report
from localmoe.documents.retrieval import Index, search_documents

__all__ = ["Chunk", "Citation", "Document", "FileProblem", "Index", "Ingested", "Passage", "Report", "Section", "analyse",
           "answer", "check_answer", "collect_files", "ingest", "search_documents"]
