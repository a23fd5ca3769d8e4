"""Nothing outside a root is ever read: the document routes of a real server with
`--documents-root`, fuzzed with `..`, absolute paths, links to files and folders outside,
link loops, hard links, NUL bytes and very long names; a secret planted outside the root
must never appear in any response body. Also the path guard itself and the Host check."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localmoe.pathguard import PathRefused, resolve_inside, walk_inside
from tests.server.conftest import start_server

SECRET = "zq-secret-7f3a91-never-served"
DOC_FACT = "The lighthouse keeper logs the tide at dawn."


def plant(base: Path) -> tuple[Path, Path]:
    """A root with documents and every kind of escape in it; the secret lives outside. Returns (root, outside)."""
    outside = base / "outside"
    (outside / "folder").mkdir(parents=True)
    for target in (outside / "secret.txt", outside / "folder" / "secret.md"):
        target.write_text(f"{SECRET}\n" * 20)
    root = base / "root"
    (root / "docs" / "deep").mkdir(parents=True)
    (root / "docs" / "notes.txt").write_text(f"{DOC_FACT}\n" * 5)
    (root / "docs" / "deep" / "more.md").write_text("Tides and keepers.\n")
    (root / "link-file.txt").symlink_to(outside / "secret.txt")
    (root / "link-folder").symlink_to(outside / "folder", target_is_directory=True)
    (root / "trap" / "deep").mkdir(parents=True)
    (root / "trap" / "deep" / "escape.txt").symlink_to(Path("../../../outside/secret.txt"))
    (root / "docs" / "inner-link.txt").symlink_to(root / "docs" / "notes.txt")  # inside: allowed
    (root / "loop-a").symlink_to(root / "loop-b")
    (root / "loop-b").symlink_to(root / "loop-a")
    (root / "self-loop").symlink_to(root / "self-loop")
    os.link(outside / "secret.txt", root / "hard-link.txt")
    (root / "walk").mkdir()
    (root / "walk" / "ok.txt").write_text("fine\n")
    (root / "walk" / "out.txt").symlink_to(outside / "secret.txt")
    (root / "walk-dir").mkdir()
    (root / "walk-dir" / "up").symlink_to(outside, target_is_directory=True)
    (root / "walk-loop").mkdir()
    (root / "walk-loop" / "again").symlink_to(root / "walk-loop", target_is_directory=True)
    (root / "walk-loop" / "x.txt").write_text("loop text\n")
    return root, outside


# ---- the guard itself ----

def test_guard_resolves_inside_and_refuses_every_escape(tmp_path):
    root, outside = plant(tmp_path)
    real_root = root.resolve()
    assert resolve_inside("docs/notes.txt", [root]) == real_root / "docs" / "notes.txt"
    assert resolve_inside(root / "docs" / "inner-link.txt", [root]) == real_root / "docs" / "notes.txt"
    assert resolve_inside(".", [root]) == real_root
    refused = {"../outside/secret.txt": True, str(outside / "secret.txt"): True, "link-file.txt": True,
               "link-folder/secret.md": True, "trap/deep/escape.txt": True, "hard-link.txt": True, "/": True,
               "loop-a": False, "self-loop/x": False, "a\0b": False, "x" * 5000: False, "": False}
    for path, outside_flag in refused.items():
        with pytest.raises(PathRefused) as info:
            resolve_inside(path, [root])
        assert info.value.outside is outside_flag, path
        assert SECRET not in str(info.value) and str(outside / "folder") not in str(info.value)


def test_walk_yields_only_files_inside_and_ends_on_loops(tmp_path):
    root, _ = plant(tmp_path)
    refused: list[str] = []
    found = list(walk_inside(root, [root], on_refused=lambda entry, e: refused.append(entry.name)))
    assert all(p.is_relative_to(root.resolve()) for p in found)
    assert root.resolve() / "walk-loop" / "x.txt" in found and root.resolve() / "walk" / "ok.txt" in found
    assert {"link-file.txt", "link-folder", "escape.txt", "loop-a", "hard-link.txt", "out.txt", "up"} <= set(refused)
    with pytest.raises(PathRefused):
        list(walk_inside(root / "walk", [root]))


# ---- the server's document routes ----

@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return plant(tmp_path_factory.mktemp("paths"))


@pytest.fixture(scope="module")
def rooted_server(tiny_model, planted, tmp_path_factory):
    root, _ = planted
    server = start_server(tiny_model, tmp_path_factory.mktemp("rooted"), "--documents-root", str(root),
                          "--no-sessions", "--max-context", "512", "--max-tokens", "4")
    yield server
    server.stop()


def _post(server, route: str, paths: list[str]) -> httpx.Response:
    body = {"query": "tide keeper", "paths": paths} if route == "search" else {
        "question": "Who logs the tide?", "paths": paths, "budget": "low", "max_tokens": 2}
    content = json.dumps(body).encode()
    return httpx.post(f"{server.url}/v1/documents/{route}", content=content,
                      headers={"content-type": "application/json"}, timeout=120)


def escapes(root: Path, outside: Path) -> list[str]:
    return ["../outside/secret.txt", str(outside / "secret.txt"), str(root / ".." / "outside" / "secret.txt"),
            str(root / "link-file.txt"), str(root / "link-folder"), str(root / "link-folder" / "secret.md"),
            str(root / "trap" / "deep" / "escape.txt"), str(root / "trap"), str(root / "hard-link.txt"),
            str(root / "walk"), str(root / "walk-dir"), str(root), "/", "/etc/passwd", "/proc/self/environ",
            "~/.bashrc", str(outside), str(root) + "/../outside", "docs/../../outside/secret.txt",
            str(root / "loop-a"), str(root / "self-loop"), str(root / "docs") + "\0/../../outside/secret.txt",
            "a" * 5000, "%2e%2e/outside/secret.txt", "docs/" + "x/" * 3000, str(root / "docs" / "deep" / ".." / ".." /
                                                                                ".." / "outside")]


def test_escapes_are_refused_and_the_secret_never_served(rooted_server, planted):
    root, outside = planted
    for route in ("search", "analyze"):
        for path in escapes(root, outside):
            response = _post(rooted_server, route, [path])
            assert 400 <= response.status_code < 500, (route, path, response.status_code, response.text[:300])
            assert SECRET not in response.text, (route, path)
            assert response.json()["error"]["message"], path
            if path in (str(root / "link-file.txt"), "/etc/passwd", str(root / "walk")):
                assert response.status_code == 403 and "--documents-root" in response.json()["error"]["message"]


def test_inside_paths_are_served(rooted_server, planted):
    root, _ = planted
    for paths in (["docs"], [str(root / "docs")], [str(root / "docs" / "notes.txt")], ["docs/inner-link.txt"],
                  [str(root / "walk-loop")]):
        response = _post(rooted_server, "search", paths)
        assert response.status_code == 200, (paths, response.text[:300])
        assert SECRET not in response.text
    texts = " ".join(p["text"] for p in _post(rooted_server, "search", ["docs"]).json()["data"])
    assert "lighthouse keeper" in texts


PIECES = ["..", ".", "docs", "trap", "deep", "notes.txt", "escape.txt", "link-file.txt", "link-folder", "secret.md",
          "loop-a", "self-loop", "hard-link.txt", "walk", "walk-dir", "up", "outside", "secret.txt", "", "~",
          "\0", "%2e%2e", "x" * 300, "\u202e", "con", "*", "?"]


@settings(max_examples=250, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(parts=st.lists(st.sampled_from(PIECES), min_size=1, max_size=8), absolute=st.sampled_from(["", "root", "/"]),
       route=st.sampled_from(["search", "search", "analyze"]))
def test_fuzzed_paths_never_serve_the_secret(rooted_server, planted, parts, absolute, route):
    root, _ = planted
    path = "/".join(parts)
    if absolute == "root":
        path = f"{root}/{path}"
    elif absolute == "/":
        path = "/" + path
    response = _post(rooted_server, route, [path])
    assert response.status_code < 500, (path, response.text[:300])
    assert SECRET not in response.text, path


# ---- the default server and the Host check ----

def test_default_server_reads_no_documents(tiny_server, planted):
    root, _ = planted
    response = _post(tiny_server, "search", [str(root / "docs" / "notes.txt")])
    assert response.status_code == 403 and "--documents-root" in response.json()["error"]["message"]
    assert DOC_FACT not in response.text


@pytest.mark.parametrize("host, status", [("evil.example", 403), ("evil.example:8000", 403), ("127.0.0.1.evil.example",
                                          403), ("localhost.", 403), ("", 403), ("localhost", 200),
                                          ("127.0.0.1:1234", 200), ("[::1]:8000", 200), ("LOCALHOST", 200)])
def test_dns_rebinding_host_check(tiny_server, host, status):
    for path in ("/v1/models", "/health", "/v1/documents/search"):
        response = httpx.get(tiny_server.url + path, headers={"host": host}, timeout=30)
        if status == 403:
            assert response.status_code == 403, (host, path)
            assert "--allowed-hosts" in response.json()["error"]["message"]
        else:
            assert response.status_code != 403, (host, path, response.text)


def test_allowed_hosts_flag(tiny_model, tmp_path):
    server = start_server(tiny_model, tmp_path, "--no-sessions", "--max-context", "256", "--allowed-hosts",
                          "box.lan,other.lan")
    try:
        for host, status in (("box.lan", 200), ("other.lan:9", 200), ("evil.example", 403), ("localhost", 200)):
            assert httpx.get(server.url + "/v1/models", headers={"host": host}, timeout=30).status_code == status
    finally:
        server.stop()


# ---- the UIs' built-in file tools (working directory as root) and the web app's uploads ----

def test_ui_tools_never_read_outside_the_working_directory(tmp_path):
    from localmoe.ui.tools import ToolRunner

    from localmoe.chat.format import ToolCall

    root, outside = plant(tmp_path)
    runner = ToolRunner(root)
    for path in ("link-file.txt", "link-folder/secret.md", "trap/deep/escape.txt", "hard-link.txt",
                 "../outside/secret.txt", str(outside / "secret.txt"), "loop-a", "a\0b", "x" * 5000):
        out = runner.run(ToolCall("read_file", {"path": path}))
        assert out.startswith("error: read_file:") and SECRET not in out, path
    for path in ("link-folder", "walk-dir/up", "loop-a"):
        out = runner.run(ToolCall("list_dir", {"path": path}))
        assert out.startswith("error: list_dir:"), path
    assert DOC_FACT in runner.run(ToolCall("read_file", {"path": "docs/inner-link.txt"}))
    found = runner.run(ToolCall("search_documents", {"query": "lighthouse keeper tide"}))
    assert SECRET not in found and "lighthouse" in found


def test_web_uploads_must_come_from_the_upload_folder(tmp_path):
    from types import SimpleNamespace

    from localmoe.ui.web.session import WebSession

    root, outside = plant(tmp_path)
    service = SimpleNamespace(sessions=None, model_id="m", warm=lambda request: None)  # no model: nothing to warm
    session = WebSession(service, tmp_path, upload_root=root / "docs")
    session.attach([root / "docs" / "notes.txt"])
    assert session.documents == [(root / "docs" / "notes.txt").resolve()]
    for path in (outside / "secret.txt", root / "link-file.txt", root / "docs" / ".." / "hard-link.txt"):
        with pytest.raises(PathRefused):
            session.attach([path])
    assert session.conversation.runner.document_roots == [root / "docs"]


def test_documents_the_user_names_are_their_own_roots(tmp_path):
    """`localmoe chat --documents FOLDER` outside the working directory: searched, but a link in it that
    leads out of FOLDER is left out."""
    from localmoe.ui.tools import ToolRunner

    from localmoe.chat.format import ToolCall

    root, outside = plant(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    runner = ToolRunner(work, document_paths=[root / "docs"])
    (root / "docs" / "leak.txt").symlink_to(outside / "secret.txt")
    try:
        found = runner.run(ToolCall("search_documents", {"query": "lighthouse keeper tide"}))
        assert "lighthouse" in found and SECRET not in found
        assert runner.run(ToolCall("read_file", {"path": str(root / "docs" / "notes.txt")})).startswith("error:")
    finally:
        (root / "docs" / "leak.txt").unlink()
