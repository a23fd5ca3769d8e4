"""Built-in tools the TUI and web app offer the model: read_file, list_dir, run_command and
search_documents. They run only after the user approves a call (the UIs ask; see
localmoe.ui.conversation), inside one working directory.

`ToolRunner.run(call)` never raises: a bad argument, a path outside the working directory,
a command that times out or a missing file all come back as text the model can read, so a
failed call is one more message in the conversation rather than a crash of the UI.

    runner = ToolRunner(Path.cwd(), timeout=30.0, output_cap=16384)
    runner.run(ToolCall("list_dir", {"path": "."}))  # -> "src/\\nREADME.md\\n..."
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from localmoe.chat.format import ToolCall
from localmoe.pathguard import PathRefused, resolve_inside, walk_inside


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


BUILTIN_TOOLS: list[dict] = [
    _function("read_file", "Read a text file in the working directory.",
              {"path": {"type": "string", "description": "Path relative to the working directory."}}, ["path"]),
    _function("list_dir", "List the entries of a directory in the working directory.",
              {"path": {"type": "string", "description": "Directory relative to the working directory ('.')."}},
              ["path"]),
    _function("run_command", "Run a shell command in the working directory; returns its exit status and output.",
              {"command": {"type": "string", "description": "The shell command line."}}, ["command"]),
    _function("search_documents", "Search the user's documents for passages relevant to a query.",
              {"query": {"type": "string", "description": "What to look for."}}, ["query"]),
]
BUILTIN_NAMES = tuple(t["function"]["name"] for t in BUILTIN_TOOLS)
MAX_LIST_ENTRIES = 500  # list_dir shows at most this many names


class ToolError(Exception):
    """A call the runner refuses (bad argument, path outside the working directory); becomes text."""


class ToolRunner:
    """Runs built-in tool calls confined to `workdir`; output longer than `output_cap` characters
    is cut (with a note saying how much was cut)."""

    def __init__(self, workdir: Path, timeout: float = 30.0, output_cap: int = 16384,
                 document_paths: list[Path] | None = None):
        self.workdir = Path(workdir).expanduser().resolve()
        if not self.workdir.is_dir():
            raise NotADirectoryError(f"{self.workdir}: the tools' working directory must be an existing directory")
        if timeout <= 0 or output_cap < 64:
            raise ValueError(f"timeout must be > 0 s (got {timeout}) and output_cap at least 64 characters "
                             f"(got {output_cap})")
        self.timeout = float(timeout)
        self.output_cap = int(output_cap)
        self.document_paths = [Path(p) for p in document_paths] if document_paths else [self.workdir]
        # search_documents reads only under these: the paths the user gave (each its own root), or the working
        # directory; a link in them that leads out is left out
        self.document_roots: list[Path] = [p if p.is_absolute() else self.workdir / p for p in self.document_paths]

    def run(self, call: ToolCall) -> str:
        """The tool's output as text; errors are returned as text starting with "error:"."""
        handler = {"read_file": self._read_file, "list_dir": self._list_dir, "run_command": self._run_command,
                   "search_documents": self._search_documents}.get(call.name)
        if handler is None:
            return f"error: unknown tool {call.name!r}; the built-in tools are {', '.join(BUILTIN_NAMES)}"
        if call.raw_arguments is not None and not call.arguments:
            return f"error: the arguments of {call.name} are not a JSON object: {call.raw_arguments[:200]!r}"
        try:
            return self._cap(handler(call.arguments))
        except ToolError as e:
            return f"error: {e}"
        except OSError as e:
            return f"error: {call.name}: {e.strerror or e}"

    # ---- argument checks ----

    @staticmethod
    def _text_argument(arguments: dict, key: str, tool: str) -> str:
        value = arguments.get(key)
        if not isinstance(value, str) or not value.strip():
            raise ToolError(f"{tool} needs a non-empty string argument {key!r} (got {value!r})")
        return value

    def _inside(self, relative: str, tool: str) -> Path:
        """`relative` resolved under the working directory (localmoe.pathguard); refuses escapes."""
        try:
            return resolve_inside(relative, [self.workdir])
        except PathRefused as e:
            if e.outside:
                raise ToolError(f"{tool}: {e.path!r} is outside the working directory {self.workdir} (or a link "
                                f"or hard link to outside it); give a path inside it") from None
            raise ToolError(f"{tool}: {e}") from None

    def _cap(self, text: str) -> str:
        if len(text) <= self.output_cap:
            return text
        cut = len(text) - self.output_cap
        return text[:self.output_cap] + f"\n[... {cut} more characters cut (output cap {self.output_cap})]"

    # ---- the tools ----

    def _read_file(self, arguments: dict) -> str:
        path = self._inside(self._text_argument(arguments, "path", "read_file"), "read_file")
        if not path.is_file():
            raise ToolError(f"read_file: {path.relative_to(self.workdir)} is not a file")
        with path.open("rb") as f:
            data = f.read(self.output_cap * 4 + 1)  # enough bytes for output_cap characters of UTF-8
        if b"\0" in data[:4096]:
            raise ToolError(f"read_file: {path.relative_to(self.workdir)} looks binary; only text files are read")
        return data.decode("utf-8", errors="replace")

    def _list_dir(self, arguments: dict) -> str:
        relative = arguments.get("path") or "."
        if not isinstance(relative, str):
            raise ToolError(f"list_dir: 'path' must be a string (got {relative!r})")
        path = self._inside(relative, "list_dir")
        if not path.is_dir():
            raise ToolError(f"list_dir: {relative} is not a directory")
        entries = sorted(path.iterdir(), key=lambda p: p.name)
        names = [p.name + ("/" if p.is_dir() else "") for p in entries[:MAX_LIST_ENTRIES]]
        if len(entries) > MAX_LIST_ENTRIES:
            names.append(f"[... {len(entries) - MAX_LIST_ENTRIES} more entries]")
        return "\n".join(names) if names else "(empty directory)"

    def _run_command(self, arguments: dict) -> str:
        command = self._text_argument(arguments, "command", "run_command")
        # its own process group: on timeout the whole pipeline is killed, not only the shell (a surviving
        # child would hold the output pipes open and the call would wait for it)
        process = subprocess.Popen(command, shell=True, cwd=self.workdir, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
                                   env={**os.environ, "PAGER": "cat"})
        try:
            stdout, stderr = process.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, _ = process.communicate()
            partial = stdout.decode("utf-8", errors="replace")
            return f"error: run_command: timed out after {self.timeout:g} s\n{partial}"
        out = stdout.decode("utf-8", errors="replace")
        err = stderr.decode("utf-8", errors="replace")
        text = f"exit status {process.returncode}\n{out}"
        if err:
            text += ("" if text.endswith("\n") else "\n") + f"[stderr]\n{err}"
        return text

    def _search_documents(self, arguments: dict) -> str:
        query = self._text_argument(arguments, "query", "search_documents")
        try:
            from localmoe.documents import search_documents
            from localmoe.documents.retrieval import not_found
        except ImportError as e:
            return f"error: search_documents is not available in this installation ({e})"
        paths = self._document_files()
        try:
            passages = search_documents(query, paths, top_k=5) if paths else []
        except Exception as e:  # noqa: BLE001 - the model reads the failure instead of the UI crashing
            return f"error: search_documents: {e}"
        if (answer := not_found(query, [f"{p.location} {p.text}" for p in passages])) is not None:
            return answer  # the same words as analyze and /v1/documents/search
        return "\n\n".join(f"[{p.source}, {p.location}] (score {p.score:.2f})\n{p.text}" for p in passages)

    def _document_files(self) -> list[Path]:
        """The readable document files of `document_paths`: each path and folder entry resolved inside
        `document_roots` (entries that lead outside are left out)."""
        from localmoe.documents.formats import supported
        from localmoe.documents.ingest import skipped

        files: list[Path] = []
        for path in self.document_paths:
            try:
                real = resolve_inside(path, self.document_roots, base=self.workdir)
            except PathRefused as e:
                raise ToolError(f"search_documents: {e}") from None
            if real.is_file():
                files.append(real)
            elif real.is_dir():
                files += [f for f in walk_inside(real, self.document_roots, on_refused=lambda *_: None,
                                                 skip=skipped) if supported(f)]
        return files
