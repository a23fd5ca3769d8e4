"""Small file helpers shared by the store writer and reader: durable finish, cache drop, full reads."""

from __future__ import annotations

import os
from pathlib import Path

from localmoe.store.manifest import PARTIAL, fsync_dir

CHUNK = 64 << 20  # bytes per write / read / hash step when streaming


def drop_cache(fd: int) -> None:
    """Tell the kernel the file's pages are not needed (the pager keeps its own copies)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def read_into(f, buf: memoryview) -> int:
    """Fill `buf` from unbuffered file `f` (a raw read may return less); returns the bytes read."""
    got = 0
    while got < len(buf) and (n := f.readinto(buf[got:])):
        got += n
    return got


def finish_file(f, partial: Path) -> Path:
    """fsync and close a `.partial` file, then rename it into place durably; returns the final path."""
    f.flush()
    os.fsync(f.fileno())
    drop_cache(f.fileno())
    f.close()
    final = partial.with_name(partial.name[:-len(PARTIAL)])
    os.replace(partial, final)
    fsync_dir(final.parent)
    return final
