"""The streaming safetensors writer: output reads back bit-exactly with the official
library, failures leave no file, and a large write never holds the file in memory."""

from __future__ import annotations

import threading
import time

import numpy as np
import psutil
import pytest
import torch
from safetensors import safe_open

from localmoe.errors import CheckpointError
from localmoe.store.safetensors_writer import TensorEntry, alignment_order, file_size, write_safetensors
from localmoe.testing.random_data import const, normal, randint, tensor_chunks

TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8, "I64": torch.int64}


def _chunks(e: TensorEntry):
    if e.dtype == "U8":
        return tensor_chunks(7, e.name, e.dtype, e.shape, randint(0, 256))
    if e.dtype == "I64":
        return [np.arange(int(np.prod(e.shape)), dtype="<i8")]
    return tensor_chunks(7, e.name, e.dtype, e.shape, normal(1.0))


def _expected(e: TensorEntry) -> bytes:
    return b"".join(bytes(memoryview(c).cast("B")) for c in _chunks(e))


def test_roundtrip_is_bit_exact(tmp_path):
    entries = alignment_order([TensorEntry("a.u8", "U8", (3, 5)), TensorEntry("b.bf16", "BF16", (4, 7)),
                               TensorEntry("c.f32", "F32", (2, 3, 5)), TensorEntry("empty", "F32", (0, 4)),
                               TensorEntry("scalar", "F16", ()), TensorEntry("ids", "I64", (9,))])
    path = write_safetensors(tmp_path / "x.safetensors", entries, _chunks, metadata={"format": "pt"})
    assert path.stat().st_size == file_size(entries, {"format": "pt"})
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(e.name for e in entries)
        for e in entries:
            t = f.get_tensor(e.name)
            assert t.dtype == TORCH[e.dtype] and tuple(t.shape) == e.shape
            assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == _expected(e), e.name
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0


def test_multi_chunk_tensor_is_seamless(tmp_path, monkeypatch):
    import localmoe.testing.random_data as rd

    monkeypatch.setattr(rd, "CHUNK_ELEMENTS", 1000)
    e = TensorEntry("w", "BF16", (37, 101))  # 4 chunks, the last one short
    assert len(list(rd.tensor_chunks(0, "w", "BF16", e.shape, normal()))) == 4
    path = write_safetensors(tmp_path / "m.safetensors", [e], lambda e: rd.tensor_chunks(0, e.name, e.dtype, e.shape,
                                                                                         normal()))
    with safe_open(path, "pt") as f:
        w = f.get_tensor("w").float()
    assert 0.015 < w.std() < 0.025 and w.abs().max() < 0.04  # uniform with std 0.02: |w| <= 0.0347
    assert len(torch.unique(w[:9].flatten())) > 100  # chunks differ from each other


def test_wrong_byte_count_leaves_nothing(tmp_path):
    entries = [TensorEntry("ok", "F32", (4,)), TensorEntry("short", "F32", (4,))]
    target = tmp_path / "bad.safetensors"
    with pytest.raises(CheckpointError, match="short"):
        write_safetensors(target, entries, lambda e: [np.zeros(4 if e.name == "ok" else 3, "<f4")])
    assert list(tmp_path.iterdir()) == []


def test_header_rejects_duplicates_and_unknown_dtypes(tmp_path):
    with pytest.raises(CheckpointError, match="twice"):
        write_safetensors(tmp_path / "d", [TensorEntry("a", "F32", (1,))] * 2, lambda e: [np.zeros(1, "<f4")])
    with pytest.raises(CheckpointError, match="dtype"):
        write_safetensors(tmp_path / "d", [TensorEntry("a", "F33", (1,))], lambda e: [b""])


def test_streaming_write_keeps_memory_flat(tmp_path):
    """~300 MB written with at most one 4 MiB chunk (plus scratch) in memory."""
    entries = [TensorEntry(f"experts.{i}", "U8", (100, 1024, 1024)) for i in range(3)]
    entries.append(TensorEntry("dense", "BF16", (4096, 4096)))
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak, stop = [base], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        path = write_safetensors(tmp_path / "big.safetensors", entries,
                                 lambda e: tensor_chunks(1, e.name, e.dtype, e.shape,
                                                         randint(0, 256) if e.dtype == "U8" else const(0.5)))
    finally:
        stop.set()
        sampler.join()
    size = path.stat().st_size
    assert size > 300 * 10**6
    assert peak[0] - base < 80 * 2**20, f"RSS grew {(peak[0] - base) / 2**20:.0f} MiB writing {size / 2**20:.0f} MiB"
    with safe_open(path, "pt") as f:
        assert float(f.get_slice("dense")[4095:, 4090:].float().min()) == 0.5
