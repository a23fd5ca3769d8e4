"""The CPU kernel library's cache key covers what it compiles: every header a source includes (directly or
through another header) is listed in `HEADERS`, whose contents the key hashes, so an edit to any of them
rebuilds the library instead of reusing a stale one; the compiler reads the very bytes that were hashed (an edit
during a build cannot land under the old key); and two processes never compile the same library side by side."""

from __future__ import annotations

import re
from pathlib import Path

from localmoe.kernels import _cpu

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _included(path: Path) -> list[Path]:
    """The project headers `path` includes with quotes, resolved as the compiler does (beside the file, then
    the -I folder)."""
    out = []
    for name in INCLUDE.findall(path.read_text()):
        for folder in (path.parent, _cpu.KERNELS / "_cpu"):
            if (folder / name).exists():
                out.append((folder / name).resolve())
                break
        else:
            raise AssertionError(f"{path}: #include \"{name}\" resolves to no file")
    return out


def test_every_included_header_is_in_the_cache_key():
    listed = {p.resolve() for p in _cpu.HEADERS}
    seen, todo = set(), [p.resolve() for p in _cpu.SOURCES]
    while todo:
        path = todo.pop()
        for header in _included(path):
            if header not in seen:
                seen.add(header)
                todo.append(header)
    missing = sorted(str(p.relative_to(_cpu.KERNELS.resolve())) for p in seen - listed)
    assert not missing, f"headers the sources include but kernels/_cpu HEADERS does not list: {missing}"


def test_a_build_waits_for_another_process_building_the_same_library(tmp_path, monkeypatch):
    """While another process holds the build lock (here a child process), `_build` waits, and finds the library
    that process built instead of compiling it again."""
    import subprocess
    import sys
    import threading

    monkeypatch.setenv("LOCALMOE_CACHE", str(tmp_path))
    target = _cpu._target("avx2", _cpu._sources())
    target.parent.mkdir(parents=True)
    holder = (f"import fcntl, sys\nf = open({str(target) + '.lock'!r}, 'a')\nfcntl.flock(f, fcntl.LOCK_EX)\n"
              f"print('held', flush=True)\nsys.stdin.readline()\nopen({str(target)!r}, 'w').write('built elsewhere')\n")
    builder = subprocess.Popen([sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert builder.stdout.readline().strip() == "held"
    compiled = []
    real_run = subprocess.run
    monkeypatch.setattr(_cpu.subprocess, "run", lambda cmd, **kw: compiled.append(cmd) if "-o" in cmd
                        else real_run(cmd, **kw))
    found = []
    waiter = threading.Thread(target=lambda: found.append(_cpu._build("avx2")))
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive() and not found, "_build did not wait for the lock"
    builder.communicate("go\n", timeout=30)
    waiter.join(30)
    assert found == [target] and target.read_text() == "built elsewhere" and not compiled


def test_the_build_compiles_the_sources_it_hashed(tmp_path, monkeypatch):
    """The compiler gets a copy of the sources as they were read for the key, in their own layout (relative
    includes resolve there), not the live tree: here the hashed bytes differ from the files on disk, as after an
    edit during a long build, and the compiler sees the hashed ones."""
    import subprocess

    monkeypatch.setenv("LOCALMOE_CACHE", str(tmp_path))
    hashed = {rel: data + b"\n// as hashed\n" for rel, data in _cpu._sources().items()}
    monkeypatch.setattr(_cpu, "_sources", lambda: hashed)
    seen = {}
    real_run = subprocess.run

    def compile_(cmd, **kw):
        if "-o" not in cmd:
            return real_run(cmd, **kw)
        tree = Path(next(a for a in cmd if a.startswith("-I"))[2:]).parent
        seen.update({p.relative_to(tree).as_posix(): p.read_bytes() for p in tree.rglob("*") if p.is_file()})
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"library")
        assert all(Path(a).is_relative_to(tree) for a in cmd if a.endswith(".cpp"))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(_cpu.subprocess, "run", compile_)
    target = _cpu._build("avx2")
    assert target == _cpu._target("avx2", hashed) and target.read_bytes() == b"library"
    assert seen == hashed
