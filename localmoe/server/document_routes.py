"""Document endpoints: /v1/documents/search (BM25 passages) and /v1/documents/analyze (a
report with checked citations). Paths are files and folders on the server's machine; the
work is the same `localmoe.documents` code `localmoe analyze` runs.

They read nothing unless the server was started with `--documents-root` (403 naming the
flag). Every path, and every entry of every folder given, must resolve (symbolic links
followed) inside one of those roots (localmoe.pathguard); otherwise the request is refused
with 403 before any file is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from localmoe.pathguard import PathRefused, resolve_inside, shown, walk_inside
from localmoe.server.errors import APIError
from localmoe.server.schemas import RequestBody

router = APIRouter()


class SearchBody(RequestBody):
    query: str = Field(min_length=1, max_length=4000)
    paths: list[str] = Field(min_length=1, max_length=1000)
    top_k: int = Field(default=5, ge=1, le=100)


class AnalyzeBody(RequestBody):
    question: str = Field(min_length=1, max_length=4000)
    paths: list[str] = Field(min_length=1, max_length=1000)
    budget: Literal["low", "high", "max"] = "high"
    max_tokens: int | None = Field(default=None, ge=1)
    include: list[str] | None = None
    exclude: list[str] | None = None


OFF = ("the document endpoints are off: no --documents-root was given; start the server with "
       "--documents-root FOLDER to let clients read the documents under FOLDER")


def _check(paths: list[str], roots: tuple[Path, ...]) -> list[Path]:
    from localmoe.documents.ingest import skipped

    if not roots:
        raise APIError(403, OFF, param="paths")
    resolved = []
    for given in paths:
        try:
            real = resolve_inside(given, roots)
            if real.is_dir():
                for _ in walk_inside(real, roots, skip=skipped):  # what the documents' walk reads
                    pass
        except PathRefused as e:
            status = 403 if e.outside else 400
            raise APIError(status, f"{e} (a path, or a link in a folder given, must stay inside the "
                                   f"--documents-root folders)", param="paths") from None
        if not real.exists():
            raise APIError(400, f"no such file or folder on the server: {shown(given)}", param="paths")
        resolved.append(real)
    return resolved


async def _paths(paths: list[str], roots: tuple[Path, ...] | None) -> list[Path]:
    """The real paths of `paths`, each checked against `roots` (folders walked off the event loop)."""
    return await run_in_threadpool(_check, paths, tuple(roots or ()))


@router.post("/v1/documents/search")
async def search(body: SearchBody, request: Request):
    """The passages of `paths` that best match `query` (BM25), best first, with file and location."""
    from localmoe.documents import search_documents
    from localmoe.documents.retrieval import not_found

    paths = await _paths(body.paths, request.app.state.service.config.documents_roots)
    passages = await run_in_threadpool(search_documents, body.query, paths, body.top_k)
    # the not-found rule of analyze and the search tool: passages holding too few of the query's words are no answer
    missing = not_found(body.query, [f"{p.location} {p.text}" for p in passages])
    if missing:
        return {"object": "list", "status": "not_found", "message": missing, "data": []}
    return {"object": "list", "status": "found", "data": [p.to_dict() for p in passages]}


@router.post("/v1/documents/analyze")
async def analyze(body: AnalyzeBody, request: Request):
    """Answer `question` over `paths`: the report (answer, checked citations, evidence, per-file problems)."""
    from localmoe.documents import answer

    service = request.app.state.service
    paths = await _paths(body.paths, service.config.documents_roots)
    report = await answer(service, paths, body.question, body.budget, include=body.include, exclude=body.exclude,
                          max_tokens=body.max_tokens)
    return {"object": "document.report", "markdown": report.to_markdown(), **report.to_dict()}
