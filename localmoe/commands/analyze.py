"""`localmoe analyze`: questions over PDFs, office files, HTML, text and code, answered with
checked citations (docs/documents.md)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from localmoe.commands.base import Command
from localmoe.commands.options import budget_option, model_options, spec_options
from localmoe.config import SPEC_K
from localmoe.errors import LocalMoEError


def _bar(total: int, unit: str, description: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=description, file=sys.stderr, disable=not enabled, leave=False,
                dynamic_ncols=True)


def _start_service(model, engine, show: bool, spec: str = "off", spec_k: int = SPEC_K):
    from localmoe.load import load_model
    from localmoe.runtime.service import ServerConfig, Service

    loaded = load_model(model, engine, progress=show)
    service = Service(loaded, ServerConfig(threads=loaded.config.resolved_threads(), spec=spec, spec_k=spec_k))
    service.start()
    return service


async def _one(service, paths, question, budget, include, exclude, max_tokens, show):
    from localmoe.documents import answer

    bars: dict[str, object] = {}

    def progress(stage: str, done: int, total: int) -> None:
        if stage not in bars:
            label = {"read": "reading", "map": "notes", "answer": "answering"}[stage]
            bars[stage] = _bar(total, "file" if stage == "read" else "step", label, show)
        bar = bars[stage]
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        return await answer(service, paths, question, budget, progress, include, exclude, max_tokens)
    finally:
        for bar in bars.values():
            bar.close()


async def _batch(service, paths, questions_file, out, fmt, budget, include, exclude, max_tokens, show):
    from localmoe.documents.batch import read_questions, run_batch

    questions = read_questions(questions_file)
    bar = _bar(None, "doc", "documents", show)

    def progress(done: int, total: int, name: str, status: str) -> None:
        bar.total = total
        bar.set_postfix_str(f"{status} {name}"[-40:])
        bar.update(1)

    try:
        return await run_batch(service, paths, questions, out, fmt, budget, include, exclude, progress, max_tokens)
    finally:
        bar.close()


@click.command("analyze", cls=Command)
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--question", "-q", default=None, help="The question to answer over all PATHS together.")
@click.option("--questions", "questions_file", default=None, type=click.Path(path_type=Path),
              help="Batch job: a file of questions (one a line), answered for each document; needs --out FOLDER.")
@model_options
@budget_option("Thinking budget and how many passages are read (low: 8, high: 32, max: 96).")
@click.option("--format", "fmt", type=click.Choice(["md", "json"]), default="md", show_default=True)
@click.option("--out", "-o", default=None, type=click.Path(path_type=Path),
              help="Write the report to this file (batch jobs: the folder of reports). Default: stdout.")
@click.option("--include", multiple=True, help="Only files matching this glob inside folders (repeatable).")
@click.option("--exclude", multiple=True, help="Skip files and folders matching this glob (repeatable).")
@click.option("--max-tokens", type=int, default=None, help="Longest answer in tokens (default: by --budget).")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@spec_options(default="prompt")
def command(paths, question, questions_file, model, engine, budget, fmt, out, include, exclude,
            max_tokens, quiet, spec, spec_k):
    """Answer questions over documents (PDF, DOCX, PPTX, XLSX, CSV, HTML, Markdown, text, code) with
    citations to file and page/sheet/slide/line, each checked against the source text."""
    if (question is None) == (questions_file is None):
        raise LocalMoEError("give either --question TEXT or --questions FILE (a batch job)")
    if questions_file is not None and out is None:
        raise LocalMoEError("a batch job (--questions) writes one report per document: give --out FOLDER")
    if max_tokens is not None and max_tokens < 1:
        raise LocalMoEError("--max-tokens must be at least 1")
    for path in paths:
        if not path.exists():
            raise LocalMoEError(f"{path}: no such file or folder")
    show = not quiet and sys.stderr.isatty()
    service = _start_service(model, engine, not quiet, spec, spec_k)
    try:
        if questions_file is not None:
            result = asyncio.run(_batch(service, list(paths), questions_file, out, fmt, budget, list(include),
                                        list(exclude), max_tokens, show))
            for problem in result.problems:
                click.echo(f"localmoe: {problem}", err=True)
            click.echo(f"{len(result.done)} reports written, {len(result.skipped)} already finished, "
                       f"{len(result.problems)} documents failed ({result.seconds:.1f} s) in {out}", err=True)
            return
        report = asyncio.run(_one(service, list(paths), question, budget, list(include), list(exclude), max_tokens,
                                  show))
    finally:
        service.stop()
    text = report.to_json() + "\n" if fmt == "json" else report.to_markdown()
    if out is None:
        click.echo(text, nl=False)
    else:
        from localmoe.documents.batch import write_atomically

        write_atomically(out, text)
        click.echo(f"report written to {out}", err=True)
    for problem in report.problems:
        click.echo(f"localmoe: {problem}", err=True)


def main() -> None:
    command(prog_name="localmoe analyze")


if __name__ == "__main__":
    main()
