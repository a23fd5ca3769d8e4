"""Batch jobs: one report per document; a crash or a kill loses no finished report, and a rerun
skips them and completes the rest."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localmoe.documents.batch import read_questions, report_path, run_batch
from tests.documents import builders

# the second question's words are in no document: it is answered "not found" without a model call
QUESTIONS = ["Who signed the cobalt procurement review?", "What did the Zanzibar turbine plant produce?"]


def _folder(tmp_path: Path, n: int) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(n):
        page = 1 + i % 3
        builders.write_pdf(folder / f"report-{i}.pdf", pages=3, seed=i,
                           facts={page: f"Auditor number {i} signed the cobalt procurement review."})
    return folder


def _run(folder, out, asker, fmt="md"):
    return asyncio.run(run_batch(None, [folder], QUESTIONS, out, fmt, "low", asker=asker))


def test_crash_keeps_finished_reports_and_rerun_completes(tmp_path):
    from tests.documents.scripted import ExtractiveAsker

    folder, out = _folder(tmp_path, 5), tmp_path / "out"
    with pytest.raises(RuntimeError, match="crashed"):
        _run(folder, out, ExtractiveAsker(crash_after=2))  # dies inside the third document
    first = sorted(out.rglob("*.md"))
    assert [p.name for p in first] == ["report-0.pdf.md", "report-1.pdf.md"]
    assert [p for p in out.iterdir() if p.name.endswith(".tmp")] == []
    stamps = {p: p.stat().st_mtime_ns for p in first}

    asker = ExtractiveAsker()
    result = _run(folder, out, asker)
    assert sorted(result.skipped) == first and len(result.done) == 3
    assert len(asker.prompts) == 3  # nothing finished was recomputed; "not found" needs no model call
    assert {p: p.stat().st_mtime_ns for p in first} == stamps
    for i in range(5):
        text = report_path(out, f"report-{i}.pdf", "md").read_text()
        assert f'report-{i}.pdf, page {1 + i % 3}: "Auditor number {i} signed' in text
        assert "Not found in the documents" in text


def test_changed_questions_redo_reports_and_json_format(tmp_path):
    from tests.documents.scripted import ExtractiveAsker

    folder, out = _folder(tmp_path, 2), tmp_path / "out"
    _run(folder, out, ExtractiveAsker(), fmt="json")
    again = asyncio.run(run_batch(None, [folder], QUESTIONS[:1], out, "json", "low", asker=ExtractiveAsker()))
    assert len(again.done) == 2 and again.skipped == []
    data = json.loads(report_path(out, "report-1.pdf", "json").read_text())
    assert [r["question"] for r in data["reports"]] == QUESTIONS[:1]
    assert data["reports"][0]["citations"][0]["location"] == "page 2"


def test_unreadable_documents_fail_alone(tmp_path):
    from tests.documents.scripted import ExtractiveAsker

    folder, out = _folder(tmp_path, 2), tmp_path / "out"
    (folder / "zero.pdf").write_bytes(b"")
    result = _run(folder, out, ExtractiveAsker())
    assert len(result.done) == 2 and [p.path.name for p in result.problems] == ["zero.pdf"]
    assert "0 bytes" in result.problems[0].message


def test_questions_file(tmp_path):
    path = tmp_path / "q.txt"
    path.write_text("# revenue questions\nWhat was revenue?\n\n  Who audited it?  \n")
    assert read_questions(path) == ["What was revenue?", "Who audited it?"]
    path.write_text("# nothing\n")
    with pytest.raises(Exception, match="no questions"):
        read_questions(path)


@pytest.mark.slow
def test_killed_batch_job_resumes(tmp_path):
    """`localmoe analyze --questions` on the embedded model, SIGKILLed after two reports, then rerun."""
    folder, out = _folder(tmp_path, 5), tmp_path / "out"
    questions = tmp_path / "q.txt"
    questions.write_text(QUESTIONS[0] + "\n")
    args = [sys.executable, "-m", "localmoe.commands.analyze", str(folder), "--questions", str(questions), "--out",
            str(out), "--budget", "low", "--max-tokens", "4", "--threads", "2", "--quiet"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while len(list(out.rglob("*.md"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    kept = {p: p.stat().st_mtime_ns for p in out.rglob("*.md")}
    assert 2 <= len(kept) < 5, proc.stdout.read().decode()[-2000:]
    rerun = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"{5 - len(kept)} reports written, {len(kept)} already finished" in rerun.stderr
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert len(list(out.rglob("*.md"))) == 5
    assert [p for p in out.iterdir() if p.name.endswith(".tmp")] == []
