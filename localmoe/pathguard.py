"""The one path guard: a path a client or a model names is read only if its real location
(every symbolic link followed) lies inside an allowed root folder.

Used by the server's document routes (roots: `--documents-root`), the UIs' built-in file
tools (root: the working directory) and the web app's uploads (root: the upload folder).

    real = resolve_inside("notes/a.txt", [Path("/srv/docs")])   # -> /srv/docs/notes/a.txt
    for entry in walk_inside(real_folder, roots): ...             # every file, each one checked

A path is refused (`PathRefused`) when it is not text, holds a NUL byte, is longer than
MAX_PATH_CHARS, runs into a symbolic-link loop, resolves outside every root, or is a file
with more than one hard link (another name of it may lie outside: a copy is read instead);
messages name the path as given, never where a link points.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from localmoe.errors import LocalMoEError

MAX_PATH_CHARS = 4096  # PATH_MAX on Linux


class PathRefused(LocalMoEError):
    """A path the guard refuses; `outside` is True when it resolves outside every root."""

    def __init__(self, message: str, path: str, outside: bool = False):
        super().__init__(message)
        self.path = path
        self.outside = outside


def real_roots(roots: Sequence[str | Path]) -> tuple[Path, ...]:
    """The roots' real paths (symbolic links followed)."""
    return tuple(Path(os.path.realpath(r)) for r in roots)


def is_inside(real: Path, roots: Sequence[Path]) -> bool:
    """Whether `real` (already resolved) is one of `roots` or below one."""
    return any(real == root or real.is_relative_to(root) for root in roots)


def shown(path: object) -> str:
    """A path as messages may quote it: at most 200 characters, NUL bytes escaped."""
    text = str(path).replace("\0", "\\0")
    return text if len(text) <= 200 else text[:197] + "..."


def resolve_inside(path: str | Path, roots: Sequence[str | Path], base: str | Path | None = None) -> Path:
    """The real path of `path` (relative paths are taken under `base`, default the first root).

    Raises PathRefused unless it resolves inside one of `roots` (see the module docstring).
    The path need not exist; callers check that afterwards on the returned real path.
    """
    if not isinstance(path, (str, Path)):
        raise PathRefused(f"a path must be text, not {type(path).__name__}", shown(path))
    text = str(path)
    if "\0" in text:
        raise PathRefused(f"{shown(text)}: a path may not contain a NUL byte", shown(text))
    if not text or len(text) > MAX_PATH_CHARS:
        raise PathRefused(f"{shown(text)}: a path must have 1 to {MAX_PATH_CHARS} characters", shown(text))
    allowed = real_roots(roots)
    if not allowed:
        raise PathRefused(f"{shown(text)}: no folder is open to reading", shown(text), outside=True)
    candidate = Path(text)
    if not candidate.is_absolute():
        candidate = Path(base if base is not None else allowed[0]) / candidate
    try:
        real = candidate.resolve()
    except RuntimeError:  # Python 3.11 reports a symbolic-link loop this way
        raise PathRefused(f"{shown(text)}: symbolic-link loop", shown(text)) from None
    except (OSError, ValueError) as e:
        raise PathRefused(f"{shown(text)}: cannot be resolved ({getattr(e, 'strerror', None) or e})",
                          shown(text)) from None
    if not is_inside(real, allowed):
        raise PathRefused(f"{shown(text)}: outside the allowed folders ({', '.join(map(str, allowed))})",
                          shown(text), outside=True)
    try:
        info = real.stat()
    except (FileNotFoundError, NotADirectoryError):
        return real  # does not exist (yet): the caller says so
    except OSError as e:  # a name too long for the file system, no permission, ...
        raise PathRefused(f"{shown(text)}: cannot be read ({e.strerror or e})", shown(text)) from None
    if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
        # another name of the same file may lie outside the roots: it cannot be told apart
        raise PathRefused(f"{shown(text)}: the file has {info.st_nlink} hard links, so it may be a file from "
                          f"outside the allowed folders; copy it instead", shown(text), outside=True)
    return real


def walk_inside(folder: Path, roots: Sequence[str | Path],
                on_refused: Callable[[Path, PathRefused], None] | None = None,
                skip: Callable[[str], bool] | None = None) -> Iterator[Path]:
    """The real paths of the files under `folder` (recursively, sorted), every entry checked.

    Entries whose name `skip(name)` accepts are passed over (neither checked nor entered):
    give the rule of the walk that will read the folder, so the check covers what it reads.

    Links to folders are followed when their target is inside a root and not visited yet
    (so a loop ends); an entry that resolves outside the roots, or cannot be resolved, is
    not yielded: `on_refused(entry, error)` hears of it, or the walk raises the PathRefused.
    """
    allowed = real_roots(roots)
    start = resolve_inside(folder, allowed)
    seen: set[Path] = {start}
    pending = [start]
    while pending:
        here = pending.pop()
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError:
            continue
        folders: list[Path] = []
        for entry in entries:
            if skip is not None and skip(entry.name):
                continue
            try:
                real = resolve_inside(entry.path, allowed)
            except PathRefused as e:
                if on_refused is None:
                    raise
                on_refused(Path(entry.path), e)
                continue
            if real.is_dir():
                if real not in seen:
                    seen.add(real)
                    folders.append(real)
            elif real.is_file():
                yield real
        pending.extend(reversed(folders))
