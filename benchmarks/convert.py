"""Conversion throughput against this disk's sequential read bandwidth.

    .venv/bin/python benchmarks/convert.py [--family kimi_k3] [--size small|large] [--experts mxfp4|keep]

Generates a test checkpoint (or reuses it from the cache directory), measures the
sequential read bandwidth of its files in the same run (O_DIRECT, 16 MiB reads), the
write bandwidth of this disk (buffered writes + fsync, as the store writer does) and a
plain file copy, drops the source's pages from the page cache, converts it and prints
the conversion's throughput in source bytes/s as a fraction of the read bandwidth (goal:
>= 0.5) and of the copy (a repack writes as much as it reads, so a copy bounds it).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

CHUNK = 16 << 20


def drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_direct(path: Path) -> int:
    """Read `path` with O_DIRECT (page cache bypassed); returns the bytes read."""
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    total = 0
    try:
        while n := os.readv(fd, [buf]):
            total += n
            if n < CHUNK:
                break
    finally:
        os.close(fd)
    return total


def write_bandwidth(directory: Path, nbytes: int) -> float:
    """Bytes/s of writing `nbytes` to a new file in `directory` and fsyncing it."""
    block = os.urandom(CHUNK)
    path = directory / "bench-write.tmp"
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.writelines(block for _ in range(max(1, nbytes // CHUNK)))
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return max(1, nbytes // CHUNK) * CHUNK / seconds


def copy_bandwidth(src: Path, directory: Path, nbytes: int) -> float:
    """Bytes/s of copying the first `nbytes` of `src` (pages dropped first) to a new file + fsync:
    the most a conversion whose store is as large as its source (a repack) can reach."""
    drop_pages(src)
    path = directory / "bench-copy.tmp"
    start = time.perf_counter()
    with open(src, "rb", buffering=0) as f, open(path, "wb") as out:
        done = 0
        while done < nbytes and (chunk := f.read(min(CHUNK, nbytes - done))):
            out.write(chunk)
            done += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    drop_pages(src)
    return done / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="kimi_k3")
    parser.add_argument("--size", default="small", choices=["small", "large"])
    parser.add_argument("--experts", default="mxfp4", choices=["mxfp4", "keep"])
    parser.add_argument("--cache", type=Path, default=None, help="where generated checkpoints are kept")
    parser.add_argument("--work", type=Path, default=None, help="where the store is written (default: a temp dir "
                                                                "beside the cache, on the same disk)")
    args = parser.parse_args()

    from localmoe.convert import convert
    from localmoe.paths import cache_dir
    from localmoe.testing import write_checkpoint

    cache = args.cache or cache_dir() / "bench"
    src = cache / f"{args.family}-{args.size}"
    if not (src / "config.json").is_file():
        print(f"generating {args.family} {args.size} into {src} ...", file=sys.stderr)
        write_checkpoint(args.family, src, size=args.size, seed=0, progress=True)
    files = sorted(p for p in src.iterdir() if p.suffix == ".safetensors")
    source_bytes = sum(p.stat().st_size for p in files)

    start = time.perf_counter()
    read = sum(read_direct(p) for p in files)
    read_bw = read / (time.perf_counter() - start)

    work = args.work or cache
    work.mkdir(parents=True, exist_ok=True)
    write_bw = write_bandwidth(work, min(source_bytes, 1 << 30))
    largest = max(files, key=lambda p: p.stat().st_size)
    copy_bw = copy_bandwidth(largest, work, min(largest.stat().st_size, 2 << 30))

    with tempfile.TemporaryDirectory(dir=work, prefix="bench-store-") as tmp:
        for p in files:
            drop_pages(p)
        result = convert(src, Path(tmp) / "store", experts=args.experts)
        throughput = source_bytes / result.seconds
        store_bytes = sum(p.stat().st_size for p in (Path(tmp) / "store").rglob("*") if p.is_file())
        shutil.rmtree(Path(tmp) / "store")

    mb = 1e6
    print(f"checkpoint     {args.family} {args.size}: {source_bytes / mb:.0f} MB in {len(files)} file(s) -> "
          f"store {store_bytes / mb:.0f} MB ({result.report['experts']['stored']})")
    print(f"disk read      {read_bw / mb:.0f} MB/s (O_DIRECT, {CHUNK >> 20} MiB reads)")
    print(f"disk write     {write_bw / mb:.0f} MB/s (buffered + fsync)")
    print(f"file copy      {copy_bw / mb:.0f} MB/s (cold read + write + fsync, one thread)")
    print(f"convert        {result.seconds:.2f} s = {throughput / mb:.0f} MB/s of source")
    print(f"ratio          {throughput / read_bw:.2f} of read bandwidth (goal >= 0.5); "
          f"{throughput / copy_bw:.2f} of a file copy")


if __name__ == "__main__":
    main()
