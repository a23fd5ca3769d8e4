"""The built-in tools (localmoe.ui.tools): confinement to the working directory, timeouts,
output caps, and errors returned as text, never raised. No model involved."""

from __future__ import annotations

import os
import sys
import time

import pytest
from localmoe.ui.tools import BUILTIN_NAMES, BUILTIN_TOOLS, ToolRunner

from localmoe.chat.format import ToolCall


def test_builtin_tools_are_openai_function_declarations():
    names = [t["function"]["name"] for t in BUILTIN_TOOLS]
    assert names == list(BUILTIN_NAMES) == ["read_file", "list_dir", "run_command", "search_documents"]
    for tool in BUILTIN_TOOLS:
        parameters = tool["function"]["parameters"]
        assert tool["type"] == "function" and parameters["type"] == "object"
        assert set(parameters["required"]) <= set(parameters["properties"])


def test_read_file_returns_the_text(workdir):
    runner = ToolRunner(workdir)
    assert runner.run(ToolCall("read_file", {"path": "docs/plan.md"})) == (workdir / "docs" / "plan.md").read_text()


@pytest.mark.parametrize("path", ["../outside.txt", "/etc/hostname", "docs/../../outside.txt"],
                         ids=["parent", "absolute", "dotdot-inside"])
def test_paths_outside_the_working_directory_are_refused(workdir, path):
    (workdir.parent / "outside.txt").write_text("secret")
    out = ToolRunner(workdir).run(ToolCall("read_file", {"path": path}))
    assert out.startswith("error: read_file:") and "outside the working directory" in out
    assert "secret" not in out


def test_a_symbolic_link_out_of_the_working_directory_is_refused(workdir):
    (workdir.parent / "outside.txt").write_text("secret")
    os.symlink(workdir.parent / "outside.txt", workdir / "link.txt")
    out = ToolRunner(workdir).run(ToolCall("read_file", {"path": "link.txt"}))
    assert "outside the working directory" in out and "secret" not in out


def test_list_dir_marks_folders_and_sorts(workdir):
    out = ToolRunner(workdir).run(ToolCall("list_dir", {"path": "."}))
    expected = sorted(p.name + ("/" if p.is_dir() else "") for p in workdir.iterdir())
    assert out.splitlines() == expected and "docs/" in expected


def test_run_command_runs_in_the_working_directory(workdir):
    out = ToolRunner(workdir).run(ToolCall("run_command", {"command": "pwd; ls; exit 3"}))
    lines = out.splitlines()
    assert lines[0] == "exit status 3"
    assert lines[1] == str(workdir.resolve())
    assert "notes.txt" in lines[2:]


def test_run_command_reports_stderr(workdir):
    out = ToolRunner(workdir).run(ToolCall("run_command", {"command": "echo oops >&2"}))
    assert out.splitlines()[-2:] == ["[stderr]", "oops"]


def test_run_command_stops_at_the_timeout(workdir):
    runner = ToolRunner(workdir, timeout=0.5)
    out = runner.run(ToolCall("run_command", {"command": f"{sys.executable} -c 'import time; time.sleep(20)'"}))
    assert out.startswith("error: run_command: timed out after 0.5 s")


def test_a_timed_out_pipeline_is_killed_whole(workdir):
    """A child of the shell that outlives it would keep the output pipe open: the whole group goes."""
    runner = ToolRunner(workdir, timeout=0.5)
    start = time.monotonic()
    out = runner.run(ToolCall("run_command", {"command": "echo started; sleep 30 | cat"}))
    assert out.startswith("error: run_command: timed out") and "started" in out
    assert time.monotonic() - start < 10


def test_output_is_cut_at_the_cap_with_a_note(workdir):
    cap = 100
    out = ToolRunner(workdir, output_cap=cap).run(ToolCall("run_command", {"command": "yes x | head -c 5000"}))
    full = "exit status 0\n" + "x\n" * 2500
    assert out.startswith(full[:cap])
    assert out.endswith(f"[... {len(full) - cap} more characters cut (output cap {cap})]")


@pytest.mark.parametrize("call, expected", [
    (ToolCall("delete_everything", {}), "unknown tool 'delete_everything'"),
    (ToolCall("read_file", {}), "read_file needs a non-empty string argument 'path'"),
    (ToolCall("run_command", {"command": 7}), "run_command needs a non-empty string argument 'command'"),
    (ToolCall("read_file", {}, raw_arguments="path=x"), "not a JSON object"),
    (ToolCall("read_file", {"path": "missing.txt"}), "read_file: missing.txt is not a file"),
    (ToolCall("list_dir", {"path": "notes.txt"}), "list_dir: notes.txt is not a directory"),
], ids=["unknown", "missing-arg", "wrong-type", "raw-arguments", "no-file", "not-dir"])
def test_bad_calls_come_back_as_error_text(workdir, call, expected):
    out = ToolRunner(workdir).run(call)
    assert out.startswith("error:") and expected in out


def test_binary_files_are_not_read(workdir):
    (workdir / "blob.bin").write_bytes(b"\x00\x01\x02" * 10)
    assert "looks binary" in ToolRunner(workdir).run(ToolCall("read_file", {"path": "blob.bin"}))


def test_runner_settings_are_checked(workdir):
    with pytest.raises(NotADirectoryError, match="must be an existing directory"):
        ToolRunner(workdir / "notes.txt")
    with pytest.raises(ValueError, match="timeout must be > 0"):
        ToolRunner(workdir, timeout=0)


def test_search_documents_finds_the_file_that_holds_the_words(workdir):
    """Uses localmoe.documents.search_documents when it is installed; otherwise the tool must
    say plainly that it is not available."""
    (workdir / "report.txt").write_text("Quarterly revenue of the zeppelin division rose sharply.\n")
    out = ToolRunner(workdir).run(ToolCall("search_documents", {"query": "zeppelin revenue"}))
    try:
        from localmoe.documents import search_documents  # noqa: F401
    except ImportError:
        assert out.startswith("error: search_documents is not available")
        return
    assert "report.txt" in out.splitlines()[0] and "zeppelin" in out
