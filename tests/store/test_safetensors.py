"""The safetensors reader: bit-exact, zero-copy reads of files written by the official
library, sharded checkpoints, and a CheckpointError naming the file for every bad file."""

from __future__ import annotations

import gc
import json
import struct
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from localmoe.errors import CheckpointError
from localmoe.store.safetensors import DTYPES, SafetensorsCheckpoint, SafetensorsFile

SHAPES = [(3, 5, 7), (1,), (), (0, 4), (2, 0, 3), (13,)]


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bits of `dtype` (any bit pattern, NaNs included: comparisons are bitwise)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)[:torch.Size(shape).numel()].reshape(shape).clone()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _write_raw(path: Path, header: dict, data: bytes) -> Path:
    """A safetensors file with a hand-made header (for the corrupt cases)."""
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


@pytest.fixture
def every_dtype(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {f"{name}.{i}": _random(dtype, shape, seed=i * 100 + k)
               for k, (name, dtype) in enumerate(DTYPES.items()) for i, shape in enumerate(SHAPES)}
    path = tmp_path / "every_dtype.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "odd shapes"})
    return path, tensors


def test_every_dtype_and_shape_reads_back_bit_exact(every_dtype):
    path, tensors = every_dtype
    with SafetensorsFile(path) as f:
        assert f.metadata == {"format": "pt", "note": "odd shapes"}
        assert sorted(f.keys()) == sorted(tensors) and len(f) == len(tensors)
        for name, want in tensors.items():
            got = f.tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(_bits(got), _bits(want)), name
            dtype, shape, nbytes, _ = f.info(name)
            assert (dtype, shape, nbytes) == (want.dtype, tuple(want.shape), want.numel() * want.element_size())


def test_tensors_are_zero_copy_views_of_one_map(every_dtype):
    path, _ = every_dtype
    f = SafetensorsFile(path)
    names = [n for n in f.keys() if f.info(n).nbytes]  # noqa: SIM118 - SafetensorsFile has keys() but is not iterable
    views = {n: f.tensor(n) for n in names}
    base = views[names[0]].data_ptr() - f.info(names[0]).offset  # address of file byte 0
    for name, view in views.items():
        # a copy would live at an unrelated address; a view sits at map start + file offset
        assert view.data_ptr() == base + f.info(name).offset, name
        assert view.untyped_storage().nbytes() == f.info(name).nbytes
    assert f.tensor(names[0]).data_ptr() == views[names[0]].data_ptr()


def test_views_are_writable_copy_on_write_and_outlive_close(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"x": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(path))
    before = path.read_bytes()
    f = SafetensorsFile(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps a read-only buffer
        x = f.tensor("x")
    x[0, 0] = 42.0
    f.close()
    del f
    gc.collect()
    assert x[0, 0].item() == 42.0 and x[1, 2].item() == 5.0  # the map lives on with the view
    assert path.read_bytes() == before  # ACCESS_COPY: the write never reaches the file
    assert SafetensorsFile(path).tensor("x")[0, 0].item() == 0.0


def test_closed_file_refuses_new_tensors(tmp_path):
    path = tmp_path / "c.safetensors"
    save_file({"x": torch.ones(2)}, str(path))
    f = SafetensorsFile(path)
    f.close()
    with pytest.raises(CheckpointError, match="closed"):
        f.tensor("x")


def _shards(tmp_path: Path) -> dict[str, torch.Tensor]:
    a = {"model.embed.weight": _random(torch.bfloat16, (7, 3), 1), "model.norm.weight": _random(torch.float32, (3,), 2)}
    b = {"lm_head.weight": _random(torch.float16, (7, 3), 3), "model.scale": _random(torch.float8_e4m3fn, (), 4)}
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    return {**a, **b}


def _index(tmp_path: Path, tensors: dict[str, torch.Tensor], weight_map: dict[str, str] | None = None) -> None:
    if weight_map is None:
        weight_map = {n: "model-00001-of-00002.safetensors" if n.startswith("model.") and n != "model.scale"
                      else "model-00002-of-00002.safetensors" for n in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_directory_with_index(tmp_path):
    tensors = _shards(tmp_path)
    _index(tmp_path, tensors)
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert sorted(ckpt.keys()) == sorted(tensors) and "lm_head.weight" in ckpt and "nope" not in ckpt
    for name, want in tensors.items():
        assert torch.equal(_bits(ckpt.tensor(name)), _bits(want))
        assert ckpt.info(name).shape == tuple(want.shape)
    assert ckpt.file_of("lm_head.weight").path.name == "model-00002-of-00002.safetensors"


def test_directory_of_shards_without_index(tmp_path):
    tensors = _shards(tmp_path)
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert sorted(ckpt.keys()) == sorted(tensors)
    assert ckpt.file_of("model.norm.weight").path.name == "model-00001-of-00002.safetensors"


def test_single_file_and_model_safetensors_directory(tmp_path):
    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    save_file({"stray": torch.ones(1)}, str(tmp_path / "other.safetensors"))  # ignored: model.safetensors wins
    assert SafetensorsCheckpoint(tmp_path).keys() == ["w"]
    assert SafetensorsCheckpoint(tmp_path / "model.safetensors").keys() == ["w"]


@pytest.mark.parametrize("case", ["missing_shard", "tensor_not_in_shard", "bad_json"])
def test_bad_index(tmp_path, case):
    tensors = _shards(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    if case == "missing_shard":
        _index(tmp_path, tensors, {**{n: "model-00002-of-00002.safetensors" for n in tensors},
                                   "extra": "model-00003-of-00003.safetensors"})
        expect = "model-00003-of-00003.safetensors"
    elif case == "tensor_not_in_shard":
        _index(tmp_path, tensors, {n: "model-00001-of-00002.safetensors" for n in tensors})
        expect = "lm_head.weight"
    else:
        index.write_text("{not json")
        expect = "not a valid safetensors index"
    with pytest.raises(CheckpointError, match=expect) as err:
        SafetensorsCheckpoint(tmp_path)
    assert index.name in str(err.value)


def test_name_in_two_shards_without_index(tmp_path):
    save_file({"w": torch.ones(1)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.zeros(1)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointError, match="'w' is in both"):
        SafetensorsCheckpoint(tmp_path)


def test_missing_path_and_empty_directory(tmp_path):
    with pytest.raises(CheckpointError, match="nothing-here"):
        SafetensorsCheckpoint(tmp_path / "nothing-here")
    with pytest.raises(CheckpointError, match="holds no .safetensors"):
        SafetensorsCheckpoint(tmp_path)


def _good_header() -> dict:
    return {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "b": {"dtype": "I8", "shape": [4], "data_offsets": [16, 20]}}


def _bad_file(tmp_path: Path, case: str) -> tuple[Path, str]:
    """(path, expected message fragment) for one kind of broken file."""
    path = tmp_path / f"{case}.safetensors"
    if case == "missing":
        return path, "no such safetensors file"
    if case == "shorter_than_8_bytes":
        path.write_bytes(b"\x05\x00\x00")
        return path, "shorter than the 8-byte header length"
    if case == "header_beyond_file":
        path.write_bytes(struct.pack("<Q", 1_000_000) + b"{}")
        return path, "header claims 1000000 bytes"
    if case == "header_not_json":
        path.write_bytes(struct.pack("<Q", 9) + b"not json!")
        return path, "not valid JSON"
    if case == "header_not_utf8":
        path.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{}")
        return path, "not valid JSON"
    if case == "header_not_object":
        return _write_raw(path, [1, 2], b""), "not a JSON object"  # type: ignore[arg-type]
    if case == "duplicate_name":
        entry = b'{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
        blob = b'{"a": ' + entry + b', "a": ' + entry + b"}"
        path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\x00\x00")
        return path, "appears twice"
    if case == "unknown_dtype":
        return _write_raw(path, {"a": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}, b"\x00"), "dtype 'F7'"
    if case == "bad_shape":
        return _write_raw(path, {"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"\x00"), "invalid shape"
    if case == "missing_field":
        return _write_raw(path, {"a": {"dtype": "U8", "shape": [1]}}, b"\x00"), "lacks dtype, shape or data_offsets"
    if case == "offsets_not_matching_shape":
        header = _good_header()
        header["a"]["shape"] = [2, 3]
        return _write_raw(path, header, bytes(20)), "need 24 bytes"
    if case == "offsets_reversed":
        header = _good_header()
        header["b"]["data_offsets"] = [20, 16]
        return _write_raw(path, header, bytes(20)), "invalid data_offsets"
    if case == "overlapping":
        header = _good_header()
        header["b"]["data_offsets"] = [12, 16]
        return _write_raw(path, header, bytes(20)), "overlap"
    if case == "bad_metadata":
        return _write_raw(path, {"__metadata__": {"n": 3}, **_good_header()}, bytes(20)), "__metadata__"
    if case == "truncated":
        save_file({"a": torch.ones(10, 10), "b": torch.ones(3)}, str(path))
        full = path.read_bytes()
        path.write_bytes(full[:-7])
        return path, f"truncated: expected at least {len(full)} bytes, found {len(full) - 7}"
    raise AssertionError(case)


BAD_CASES = ["missing", "shorter_than_8_bytes", "header_beyond_file", "header_not_json", "header_not_utf8",
             "header_not_object", "duplicate_name", "unknown_dtype", "bad_shape", "missing_field",
             "offsets_not_matching_shape", "offsets_reversed", "overlapping", "bad_metadata", "truncated"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_file_raises_checkpoint_error_naming_it(tmp_path, case):
    path, expect = _bad_file(tmp_path, case)
    for opener in (SafetensorsFile, SafetensorsCheckpoint):
        with pytest.raises(CheckpointError) as err:
            opener(path)
        message = str(err.value)
        assert path.name in message, message
        assert expect in message, message
        assert "\n" not in message


def test_hand_written_good_file_and_unknown_tensor(tmp_path):
    data = torch.arange(4, dtype=torch.float32).numpy().tobytes() + bytes([1, 2, 3, 4])
    f = SafetensorsFile(_write_raw(tmp_path / "ok.safetensors", _good_header(), data))
    assert f.tensor("a").tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert f.tensor("b").tolist() == [1, 2, 3, 4]
    assert f.metadata == {}
    with pytest.raises(CheckpointError, match="no tensor 'c'"):
        f.tensor("c")
