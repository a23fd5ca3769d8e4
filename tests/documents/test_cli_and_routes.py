"""`localmoe analyze` (click CliRunner) and the /v1/documents routes, on the embedded model with few tokens."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from localmoe.commands.analyze import command
from tests.documents import builders

QUESTION = "Who signed the cobalt procurement review?"


@pytest.fixture(scope="module")
def small_pdf(tmp_path_factory):
    """A 3-page PDF at an absolute path of about 200 characters (labels in the prompt stay short)."""
    folder = tmp_path_factory.mktemp("small")
    while len(str(folder)) < 170:
        folder = folder / "board-minutes-and-audits"
    folder.mkdir(parents=True)
    return builders.write_pdf(folder / "audit.pdf", pages=3, facts={2: builders.PDF_FACTS[7]}, words_per_page=40)


def test_analyze_json_report_cites_the_page(small_pdf, tmp_path):
    out = tmp_path / "report.json"
    result = CliRunner().invoke(command, [str(small_pdf), "-q", QUESTION, "--format", "json", "--out", str(out),
                                          "--budget", "low", "--max-tokens", "8", "--threads", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert len(str(small_pdf)) >= 190 and small_pdf.is_absolute()
    assert report["mode"] == "long-context" and report["budget"] == "low"
    assert report["status"] in ("cited", "uncited") and report["passages"][0]["source"] == str(small_pdf)
    assert report["stats"]["completion_tokens"] <= 8 and report["stats"]["pages"] == 3
    assert report["evidence"][0]["source"] == str(small_pdf) and report["evidence"][0]["location"] == "page 2"
    assert "Priya Ramaswamy" in report["evidence"][0]["quote"]
    assert all(c["verified"] for c in report["citations"])


def test_analyze_speculates_by_default_and_answers_as_without(small_pdf, tmp_path, monkeypatch):
    """`analyze` drafts from the passages by default (`--spec prompt`: its answers quote them), losslessly: the
    report's answer, citations and token count equal those of `--spec off` (greedy, repetition penalty 1.1)."""
    from localmoe.commands import analyze

    default = next(p for p in command.params if p.name == "spec").default
    assert default == "prompt"
    services, start = [], analyze._start_service
    monkeypatch.setattr(analyze, "_start_service", lambda *a, **k: services.append(start(*a, **k)) or services[-1])
    reports = {}
    for spec in ("prompt", "off"):
        out = tmp_path / f"{spec}.json"
        args = [str(small_pdf), "-q", QUESTION, "--format", "json", "--out", str(out), "--budget", "low",
                "--max-tokens", "40", "--threads", "2", "--quiet"] + ([] if spec == default else ["--spec", spec])
        result = CliRunner().invoke(command, args)
        assert result.exit_code == 0, result.output
        reports[spec] = json.loads(out.read_text())
    on, off = reports["prompt"], reports["off"]
    assert services[0].speculation.stats.steps > 0 and services[1].speculation.stats.steps == 0
    assert on["answer"] == off["answer"] and on["citations"] == off["citations"]
    assert on["stats"]["completion_tokens"] == off["stats"]["completion_tokens"] > 8


def test_analyze_usage_errors(small_pdf, tmp_path):
    runner = CliRunner()
    neither = runner.invoke(command, [str(small_pdf)])
    assert neither.exit_code == 1 and "--question" in neither.output
    batch_without_out = runner.invoke(command, [str(small_pdf), "--questions", str(small_pdf)])
    assert batch_without_out.exit_code == 1 and "--out FOLDER" in batch_without_out.output
    missing = runner.invoke(command, [str(tmp_path / "nope.pdf"), "-q", "x"])
    assert missing.exit_code == 1 and "no such file" in missing.output


@pytest.fixture(scope="module")
def client(service):
    from fastapi.testclient import TestClient

    from localmoe.server.app import create_app

    return TestClient(create_app(service), base_url="http://localhost")  # no lifespan: the service fixture is already started


def test_search_route_ranks_the_planted_page(client, corpus):
    folder, _ = corpus
    response = client.post("/v1/documents/search", json={"query": QUESTION, "paths": [str(folder)], "top_k": 2})
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "found"
    best = response.json()["data"][0]
    assert (best["source"], best["location"]) == ("plant-report.pdf", "page 7")
    assert builders.PDF_FACTS[7] in " ".join(best["text"].split())


def test_search_route_answers_not_found_as_analyze_does(client, corpus):
    """A query sharing one stray word with the files ("plant") still gets BM25 hits, but none holds a third
    of its topic words: the route answers not found, with analyze's message, and no passages."""
    from localmoe.documents import search_documents

    folder, _ = corpus
    query = "Which plant keeps the zebra saxophone quartet?"
    assert search_documents(query, [folder], 5)  # BM25 alone returns passages: the rule is what rejects them
    response = client.post("/v1/documents/search", json={"query": query, "paths": [str(folder)]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "not_found" and body["data"] == []
    assert body["message"].startswith("Not found in the documents") and "saxophone" in body["message"]
    analysed = client.post("/v1/documents/analyze", json={"question": query, "paths": [str(folder)], "budget": "low"})
    assert analysed.json()["status"] == "not_found" and analysed.json()["answer"] == body["message"]


def test_analyze_route_returns_a_checked_report(client, small_pdf):
    response = client.post("/v1/documents/analyze", json={"question": QUESTION, "paths": [str(small_pdf)],
                                                           "budget": "low", "max_tokens": 6})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["evidence"][0]["location"] == "page 2"
    # 6 tokens leave no room for a citation: the evidence is there, labelled as uncited
    assert body["status"] == "uncited" and "## Uncited evidence" in body["markdown"]
    assert all(c["verified"] for c in body["citations"])


def test_routes_name_missing_paths(client, tmp_path):
    response = client.post("/v1/documents/search", json={"query": "x", "paths": [str(tmp_path / "gone")]})
    assert response.status_code == 400 and "gone" in response.json()["error"]["message"]
    bad_budget = client.post("/v1/documents/analyze", json={"question": "x", "paths": [str(tmp_path)],
                                                             "budget": "huge"})
    assert bad_budget.status_code == 400 and "budget" in bad_budget.json()["error"]["message"]


def test_documents_root_confines_the_routes(service, small_pdf, tmp_path):
    """With ServerConfig.documents_roots (`serve --documents-root`) a path outside them, or a symlink
    inside one that leads out, is refused with 403 before anything is read; inside works."""
    from dataclasses import replace

    from fastapi.testclient import TestClient

    from localmoe.server.app import create_app

    inside = tmp_path / "shared"
    inside.mkdir()
    (inside / "report.pdf").write_bytes(small_pdf.read_bytes())
    (inside / "escape.pdf").symlink_to(small_pdf)  # small_pdf lives outside `inside`
    original = service.config
    try:
        service.config = replace(original, documents_roots=(inside.resolve(),))
        client = TestClient(create_app(service), base_url="http://localhost")
        ok = client.post("/v1/documents/search", json={"query": QUESTION, "paths": [str(inside / "report.pdf")]})
        assert ok.status_code == 200, ok.text
        for path in (small_pdf, inside / "escape.pdf", inside / ".." / small_pdf.name):
            refused = client.post("/v1/documents/search", json={"query": "x", "paths": [str(path)]})
            assert refused.status_code == 403 and "documents" in refused.json()["error"]["message"], path
        service.config = replace(original, documents_roots=())
        none = TestClient(create_app(service), base_url="http://localhost").post("/v1/documents/analyze", json={
            "question": "x", "paths": [str(inside / "report.pdf")]})
        assert none.status_code == 403 and "no --documents-root" in none.json()["error"]["message"]
    finally:
        service.config = original


def test_analyze_route_refuses_a_reply_that_leaves_no_room(client, small_pdf):
    response = client.post("/v1/documents/analyze", json={"question": QUESTION, "paths": [str(small_pdf)],
                                                           "max_tokens": 8150})
    assert response.status_code == 400 and "no room for passages" in response.json()["error"]["message"]
