"""Document endpoints: /v1/documents/search (BM25 passages) and /v1/documents/analyze (a
report with checked citations). Paths are files and folders on the server's machine; the
work is the same `localmoe.documents` code `localmoe analyze` runs. With `--documents-root`
(ServerConfig.documents_roots) a path must resolve, symlinks followed, inside one of those
folders; others are refused with 403 before anything is read."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from localmoe.server.errors import APIError
from localmoe.server.schemas import Body

router = APIRouter()


class SearchBody(Body):
    query: str = Field(min_length=1, max_length=4000)
    paths: list[str] = Field(min_length=1, max_length=1000)
    top_k: int = Field(default=5, ge=1, le=100)


class AnalyzeBody(Body):
    question: str = Field(min_length=1, max_length=4000)
    paths: list[str] = Field(min_length=1, max_length=1000)
    budget: Literal["low", "high", "max"] = "high"
    max_tokens: int | None = Field(default=None, ge=1)
    include: list[str] | None = None
    exclude: list[str] | None = None


def _paths(paths: list[str], roots: tuple[Path, ...] | None) -> list[Path]:
    resolved = [Path(p).expanduser() for p in paths]
    if roots is not None:
        outside = [str(p) for p in resolved if not any(p.resolve().is_relative_to(root) for root in roots)]
        if outside:
            allowed = ", ".join(map(str, roots)) or "none: no --documents-root was given"
            raise APIError(403, f"outside the folders this server reads documents from ({allowed}): "
                                f"{', '.join(outside)}", param="paths")
    missing = [str(p) for p in resolved if not p.exists()]
    if missing:
        raise APIError(400, f"no such file or folder on the server: {', '.join(missing)}", param="paths")
    return resolved


@router.post("/v1/documents/search")
async def search(body: SearchBody, request: Request):
    """The passages of `paths` that best match `query` (BM25), best first, with file and location."""
    from localmoe.documents import search_documents

    paths = _paths(body.paths, request.app.state.service.config.documents_roots)
    passages = await run_in_threadpool(search_documents, body.query, paths, body.top_k)
    return {"object": "list", "data": [p.to_dict() for p in passages]}


@router.post("/v1/documents/analyze")
async def analyze(body: AnalyzeBody, request: Request):
    """Answer `question` over `paths`: the report (answer, checked citations, evidence, per-file problems)."""
    from localmoe.documents import answer

    service = request.app.state.service
    paths = _paths(body.paths, service.config.documents_roots)
    report = await answer(service, paths, body.question, body.budget, include=body.include, exclude=body.exclude,
                          max_tokens=body.max_tokens)
    return {"object": "document.report", "markdown": report.to_markdown(), **report.to_dict()}
