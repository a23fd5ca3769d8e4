"""Files and folders -> Documents: each file through its format's reader, folders walked
recursively with include/exclude globs; every problem is recorded per file and the rest
of the batch goes on."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from pathlib import Path

from localmoe.documents.formats import UnreadableFile, reader_for, supported
from localmoe.documents.records import Document, FileProblem, Ingested
from localmoe.errors import LocalMoEError

# directories a folder walk never enters (unless a path names them directly)
SKIPPED_DIRS = {".git", ".hg", ".svn", "__pycache__", "node_modules", ".venv", "venv", ".mypy_cache",
                ".pytest_cache", ".ruff_cache", ".tox", "dist", "build", ".ipynb_checkpoints"}


def skipped(name: str) -> bool:
    """Whether a folder walk passes over the entry `name`: hidden, or one of SKIPPED_DIRS (the server's
    and the tools' path checks walk with the same rule, so what they check is what is read)."""
    return name.startswith(".") or name in SKIPPED_DIRS


MAX_FILE_BYTES = 512 << 20  # larger files are refused with a message rather than read into memory

Progress = Callable[[int, int, Path], None]  # (files done, files in all, the file just read)


def _matches(relative: str, patterns: Iterable[str]) -> bool:
    """fnmatch against the relative path and the file name ("*.pdf" matches in every folder)."""
    name = relative.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(relative, p) or fnmatch.fnmatch(name, p) for p in patterns)


def collect_files(paths: list[Path], include: list[str] | None = None,
                  exclude: list[str] | None = None) -> list[Path]:
    """The files `paths` name (see `collect_named`), without their display names."""
    return [path for path, _ in collect_named(paths, include, exclude)]


def collect_named(paths: list[Path], include: list[str] | None = None,
                  exclude: list[str] | None = None) -> list[tuple[Path, str]]:
    """The files `paths` name: files as given, folders walked (sorted, hidden and build folders skipped).

    `include` globs keep only matching files found in folders; `exclude` globs drop files
    (and whole folders) from the walk. Raises LocalMoEError for a path that does not exist."""
    files: list[tuple[Path, str]] = []
    seen: set[Path] = set()
    for path in paths:
        path = Path(path)
        if not path.exists():
            raise LocalMoEError(f"{path}: no such file or folder; give PDF, office, HTML, text files or folders")
        if path.is_file():
            found = [(path, str(path))]
        else:
            found = []
            for item in sorted(path.rglob("*")):
                relative = item.relative_to(path).as_posix()
                parts = relative.split("/")
                if any(skipped(p) for p in parts[:-1]) or parts[-1].startswith("."):
                    continue
                if exclude and any(_matches("/".join(parts[:i + 1]), exclude) for i in range(len(parts))):
                    continue
                if not item.is_file():
                    continue
                if include:
                    if not _matches(relative, include):
                        continue
                elif not supported(item):
                    continue
                found.append((item, relative))
        for item, name in found:
            key = item.resolve()
            if key not in seen:
                seen.add(key)
                files.append((item, name))
    return files


def read_document(path: Path, display: str = "") -> tuple[Document | None, list[FileProblem]]:
    """One file -> (its Document or None, its problems); `display` names it in citations."""
    try:
        size = path.stat().st_size
        if size == 0:
            return None, [FileProblem(path, "empty file (0 bytes); nothing to analyse")]
        if size > MAX_FILE_BYTES:
            return None, [FileProblem(path, f"{size / 2**20:.0f} MiB is larger than the {MAX_FILE_BYTES >> 20} MiB "
                                            "a document may have; split it")]
        parsed = reader_for(path)(path)
    except UnreadableFile as e:
        return None, [FileProblem(path, str(e))]
    except PermissionError:
        return None, [FileProblem(path, "permission denied; make the file readable")]
    except OSError as e:
        return None, [FileProblem(path, f"cannot be read ({e.strerror or e})")]
    problems = [FileProblem(path, message) for message in parsed.problems]
    if not parsed.sections:
        if not problems:
            problems.append(FileProblem(path, "no text found in this file"))
        return None, problems
    return Document(path, parsed.kind, parsed.sections, pages=parsed.pages, display=display), problems


def ingest(paths: list[Path], include: list[str] | None = None, exclude: list[str] | None = None,
           progress: Progress | None = None) -> Ingested:
    """Read every file `paths` name (folders recursively) into Documents; problems are per file."""
    files = collect_named([Path(p) for p in paths], include, exclude)
    result = Ingested()
    for done, (path, display) in enumerate(files, start=1):
        document, problems = read_document(path, display)
        if document is not None:
            result.documents.append(document)
        result.problems.extend(problems)
        if progress is not None:
            progress(done, len(files), path)
    return result
