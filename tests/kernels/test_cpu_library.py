"""The CPU kernel library's cache key covers what it compiles: every header a source includes (directly or
through another header) is listed in `HEADERS`, whose contents the key hashes, so an edit to any of them
rebuilds the library instead of reusing a stale one; and two processes never compile the same library side by side."""

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
    target = _cpu._target("avx2")
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
