"""The CPU kernel library's cache key covers what it compiles: every header a source includes (directly or
through another header) is listed in `HEADERS`, whose contents the key hashes, so an edit to any of them
rebuilds the library instead of reusing a stale one."""

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
