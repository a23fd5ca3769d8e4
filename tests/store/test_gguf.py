"""The GGUF reader and the torch dequantisers: the header equal to `gguf.GGUFReader`'s and every
tensor bit-exact against gguf's numpy reference, on random blocks and on the real SmolLM2 file;
bad files raise CheckpointError."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from localmoe.default_model import default_model_path
from localmoe.errors import CheckpointError
from localmoe.quant import ggml as ggml_quants
from localmoe.quant.ggml import SUPPORTED_TYPES, dequantize
from localmoe.store.gguf import GGUFFile
from localmoe.testing.ggml_blocks import STEP_FIELDS, set_f16

QUANTIZABLE = {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4}  # gguf.quants.quantize does these


def _random_blocks(qtype: T, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random stored bytes for a tensor of `shape` (PyTorch order), with sane scale fields."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_size
    if qtype in (T.F32, T.F16, T.BF16):
        values = rng.standard_normal(n_blocks).astype(np.float32)
        return gguf.quants.quantize(values, qtype).view(np.uint8).reshape(*shape[:-1], -1)
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for at in STEP_FIELDS.get(qtype, ()):  # kept finite so the reference (and we) never multiply by NaN/inf,
        # whose payloads need not match bit for bit
        set_f16(blocks, qtype, at, rng.standard_normal(n_blocks) * 0.05)
    if qtype == T.MXFP4:
        blocks[:, 0] = rng.integers(100, 150, n_blocks)  # E8M0 scales 2^-27 .. 2^22: no overflow
    return blocks.reshape(*shape[:-1], -1)


def _reference(raw: np.ndarray, qtype: T) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))


def _assert_bit_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def _shapes(qtype: T) -> list[tuple[int, ...]]:
    b = GGML_QUANT_SIZES[qtype][0]
    return [(b,), (3, 2 * b), (2, 5, b), (7, 9 * b)]


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_random_blocks_bit_exact(qtype):
    for seed, shape in enumerate(_shapes(qtype)):
        raw = _random_blocks(qtype, shape, seed)
        got = dequantize(torch.from_numpy(raw), qtype, shape)
        _assert_bit_equal(got, _reference(raw, qtype).reshape(shape))


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_chunked_and_at_odd_storage_offset(qtype, monkeypatch):
    block_size = GGML_QUANT_SIZES[qtype][0]
    monkeypatch.setattr(ggml_quants, "_CHUNK_ELEMENTS", 2 * block_size)  # chunks of 2 blocks, the last of 1
    shape = (5, block_size)
    raw = _random_blocks(qtype, shape, 7)
    buf = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(raw.reshape(-1))  # a view starting at byte 1 of its storage
    got = dequantize(buf[1:], qtype, shape)
    _assert_bit_equal(got, _reference(raw, qtype).reshape(shape))


@pytest.mark.parametrize("qtype", sorted(QUANTIZABLE - {T.F32, T.F16, T.BF16}), ids=lambda t: t.name)
def test_dequantize_blocks_from_gguf_quantize_bit_exact(qtype):
    rng = np.random.default_rng(1)
    block_size = GGML_QUANT_SIZES[qtype][0]
    values = (rng.standard_normal((6, 4 * block_size)) * rng.uniform(0.01, 3, (6, 1))).astype(np.float32)
    values[0, :block_size] = 0  # an all-zero block: scale 0
    raw = gguf.quants.quantize(values, qtype)
    got = dequantize(torch.from_numpy(raw), qtype, values.shape)
    _assert_bit_equal(got, _reference(raw, qtype))


def test_dequantize_other_dtypes_and_zero_copy_float32():
    raw = _random_blocks(T.Q4_1, (4, 64), 3)
    full = dequantize(torch.from_numpy(raw), T.Q4_1, (4, 64))
    assert torch.equal(dequantize(torch.from_numpy(raw), T.Q4_1, (4, 64), torch.bfloat16), full.to(torch.bfloat16))
    f32 = torch.from_numpy(_random_blocks(T.F32, (3, 8), 4))
    assert dequantize(f32, T.F32, (3, 8)).data_ptr() == f32.data_ptr()


def test_dequantize_rejects_unsupported_type_and_wrong_sizes():
    with pytest.raises(CheckpointError, match="NVFP4 is not supported; supported types: F32, F16, BF16, Q4_0"):
        dequantize(torch.zeros(36, dtype=torch.uint8), T.NVFP4, (64,))
    with pytest.raises(CheckpointError, match="needs 40 bytes, got 39"):
        dequantize(torch.zeros(39, dtype=torch.uint8), T.Q4_1, (2, 32))
    with pytest.raises(CheckpointError, match="not a multiple of the 32-value block"):
        dequantize(torch.zeros(20, dtype=torch.uint8), T.Q4_1, (16, 2))


@pytest.fixture(scope="module")
def smollm2() -> GGUFFile:
    return GGUFFile(default_model_path())


@pytest.fixture(scope="module")
def reader() -> gguf.GGUFReader:
    # the independent reference; ~5 s, so once per module. Mode "c": writable (copy-on-write)
    # arrays, so torch.from_numpy on its F32 tensors does not warn
    return gguf.GGUFReader(default_model_path(), "c")


def test_real_model_header_equals_gguf_reader(smollm2, reader):
    want = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(smollm2.metadata) == list(want)
    for key, value in want.items():
        got = smollm2.metadata[key]
        assert got == value and type(got) is type(value), key  # 1 == 1.0 == True: types matter too
        if isinstance(value, list):
            assert [type(v) for v in got] == [type(v) for v in value], key
    assert smollm2.version == reader.fields["GGUF.version"].contents()
    ours = [(i.name, i.ggml_type, i.shape, i.nbytes, i.offset) for i in map(smollm2.info, smollm2.tensor_names())]
    assert ours == [(t.name, t.tensor_type, tuple(reversed(t.shape.tolist())), t.n_bytes, t.data_offset)
                    for t in reader.tensors]


def test_real_model_metadata(smollm2):
    assert smollm2.architecture == "llama"
    md = smollm2.metadata
    assert md["llama.embedding_length"] == 576 and md["llama.block_count"] == 30
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and all(isinstance(t, str) for t in tokens[:100]) and tokens[1] == "<|im_start|>"
    assert isinstance(md["tokenizer.chat_template"], str)
    assert "GGUF.version" not in md and smollm2.version == 3


def test_real_model_shapes_are_pytorch_order(smollm2):
    assert smollm2.info("blk.0.ffn_gate.weight").shape == (1536, 576)
    assert smollm2.info("blk.0.ffn_down.weight").shape == (576, 1536)
    assert smollm2.info("blk.0.attn_k.weight").shape == (192, 576)
    embd = smollm2.info("token_embd.weight")
    assert (embd.ggml_type, embd.shape, embd.nbytes) == (T.Q8_0, (49152, 576), 49152 * 576 // 32 * 34)
    assert smollm2.tensor("blk.0.ffn_gate.weight").shape == (1536, 576)
    assert len(smollm2.tensor_names()) == 272 and "output_norm.weight" in smollm2


def test_real_model_every_tensor_matches_reference(smollm2, reader):
    types = set()
    for t in reader.tensors:
        got = smollm2.tensor(t.name)
        want = _reference(t.data, t.tensor_type)
        assert got.shape == smollm2.info(t.name).shape == tuple(want.shape), t.name
        _assert_bit_equal(got, want)
        types.add(t.tensor_type)
    assert types == {T.Q4_1, T.Q8_0, T.F32}


def test_real_model_raw_is_zero_copy(smollm2):
    a, b = smollm2.info("blk.0.ffn_gate.weight"), smollm2.info("blk.0.ffn_up.weight")
    ra, rb = smollm2.raw(a.name), smollm2.raw(b.name)
    assert ra.dtype == torch.uint8 and ra.shape == (1536, 576 // 32 * 20) and ra.numel() == a.nbytes
    assert rb.data_ptr() - ra.data_ptr() == b.offset - a.offset  # both views into one map of the file
    with open(smollm2.path, "rb") as f:
        f.seek(a.offset)
        assert f.read(64) == ra.reshape(-1)[:64].numpy().tobytes()
    norm = smollm2.tensor("blk.0.attn_norm.weight")  # F32 -> float32: a view, not a copy
    assert norm.data_ptr() == smollm2.raw("blk.0.attn_norm.weight").data_ptr()


@pytest.mark.parametrize("keep", [50_000_000, 1_785_664, 600_000, 1000, 10],
                         ids=["in_data", "header_only", "in_vocab", "in_metadata", "in_counts"])
def test_truncated_real_file(tmp_path, keep):
    path = tmp_path / "SmolLM2-cut.gguf"
    with open(default_model_path(), "rb") as src:
        path.write_bytes(src.read(keep))
    with pytest.raises(CheckpointError, match="truncated") as err:
        GGUFFile(path)
    assert str(path) in str(err.value)
    if keep >= 1_785_664:  # all of the header is there: the exact size is known
        size = default_model_path().stat().st_size
        assert f"expected at least {size} bytes, found {keep}" in str(err.value)


def test_not_gguf_missing_and_empty(tmp_path):
    other = tmp_path / "model.safetensors"
    other.write_bytes(struct.pack("<Q", 2) + b"{}")
    for path, expect in [(other, "not a GGUF file"), (tmp_path / "absent.gguf", "no such GGUF file")]:
        with pytest.raises(CheckpointError, match=expect) as err:
            GGUFFile(path)
        assert str(path) in str(err.value)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty.gguf is not a GGUF file"):
        GGUFFile(tmp_path / "empty.gguf")


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, T]]) -> None:
    writer = gguf.GGUFWriter(path, "tiny")
    writer.add_uint32("tiny.block_count", 1)
    writer.add_array("tiny.list", [1, 2, 3])
    for name, (raw, qtype) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_written_file_with_every_supported_type(tmp_path):
    tensors = {f"t.{q.name}": (_random_blocks(q, (3, 2 * GGML_QUANT_SIZES[q][0]), i), q)
               for i, q in enumerate(SUPPORTED_TYPES)}
    _write_gguf(tmp_path / "tiny.gguf", tensors)
    f = GGUFFile(tmp_path / "tiny.gguf")
    assert f.architecture == "tiny" and f.metadata["tiny.list"] == [1, 2, 3]
    for name, (raw, qtype) in tensors.items():
        info = f.info(name)
        assert info.ggml_type == qtype and info.shape == (3, 2 * GGML_QUANT_SIZES[qtype][0])
        _assert_bit_equal(f.tensor(name), _reference(raw, qtype).reshape(info.shape))
        assert f.tensor(name, torch.float16).dtype == torch.float16


def test_unsupported_tensor_type_names_file_and_tensor(tmp_path):
    raw = np.zeros((2, GGML_QUANT_SIZES[T.NVFP4][1]), dtype=np.uint8)
    _write_gguf(tmp_path / "nvfp4.gguf", {"w": (raw, T.NVFP4)})
    f = GGUFFile(tmp_path / "nvfp4.gguf")
    assert f.info("w").shape == (2, 64)
    with pytest.raises(CheckpointError, match=r"nvfp4.gguf: tensor 'w': ggml tensor type NVFP4 is not supported"):
        f.tensor("w")
    with pytest.raises(CheckpointError, match="no tensor 'nope'"):
        f.info("nope")


def _corrupt(path: Path, find: bytes, replace: bytes) -> None:
    data = path.read_bytes()
    assert data.count(find) == 1
    path.write_bytes(data.replace(find, replace))


@pytest.mark.parametrize("case", ["huge_array", "bad_value_type", "bad_tensor_type", "unaligned_offset",
                                  "bad_version"])
def test_corrupt_header(tmp_path, case):
    path = tmp_path / f"{case}.gguf"
    _write_gguf(path, {"w": (_random_blocks(T.Q8_0, (2, 32), 0), T.Q8_0)})
    key = b"tiny.list"
    if case == "huge_array":  # element type INT32 (5), then a count of 2^60
        _corrupt(path, key + struct.pack("<IIQ", 9, 5, 3), key + struct.pack("<IIQ", 9, 5, 1 << 60))
        expect = "truncated or corrupt"
    elif case == "bad_value_type":
        _corrupt(path, key + struct.pack("<I", 9), key + struct.pack("<I", 77))
        expect = "unknown value type 77"
    elif case == "bad_tensor_type":  # name "w", 2 dims (32, 2), type Q8_0 (8)
        info = b"\x01" + bytes(7) + b"w" + struct.pack("<IQQI", 2, 32, 2, 8)
        _corrupt(path, info, info[:-4] + struct.pack("<I", 999))
        expect = "unknown ggml type 999"
    elif case == "unaligned_offset":  # the same tensor info, data offset 0 -> 8
        info = b"\x01" + bytes(7) + b"w" + struct.pack("<IQQIQ", 2, 32, 2, 8, 0)
        _corrupt(path, info, info[:-8] + struct.pack("<Q", 8))
        expect = "tensor 'w' starts at data offset 8, not a multiple of the file's 32-byte alignment"
    else:
        _corrupt(path, b"GGUF" + struct.pack("<I", 3), b"GGUF" + struct.pack("<I", 99))
        expect = "GGUF version 99, which localmoe cannot read"
    with pytest.raises(CheckpointError, match=expect) as err:
        GGUFFile(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_closed_file(tmp_path):
    _write_gguf(tmp_path / "c.gguf", {"w": (_random_blocks(T.F32, (4,), 0), T.F32)})
    with GGUFFile(tmp_path / "c.gguf") as f:
        w = f.tensor("w")
    assert w.shape == (4,)
    with pytest.raises(CheckpointError, match="closed"):
        f.tensor("w")


def test_metadata_value_types(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "kv.gguf", "tiny")
    V = gguf.GGUFValueType
    values = {"s": ("Grüße ▁<0x0A>", V.STRING), "i8": (-5, V.INT8), "u64": (1 << 63, V.UINT64),
              "i64": (-(1 << 40), V.INT64), "f32": (0.1, V.FLOAT32), "f64": (0.1, V.FLOAT64), "b": (True, V.BOOL)}
    for key, (value, vtype) in values.items():
        writer.add_key_value(key, value, vtype)
    writer.add_array("strings", ["", "a b", "你好", "<|im_end|>"])
    writer.add_key_value("u8s", [0, 255], V.ARRAY, sub_type=V.UINT8)
    writer.add_array("floats", [0.5, -2.0])
    writer.add_array("bools", [False, True])
    writer.add_array("nested", [[1, 2], [3]])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    md = GGUFFile(tmp_path / "kv.gguf").metadata
    assert md["s"] == "Grüße ▁<0x0A>" and md["i8"] == -5 and md["u64"] == 1 << 63 and md["i64"] == -(1 << 40)
    assert md["f32"] == float(np.float32(0.1)) and md["f64"] == 0.1 and md["b"] is True
    assert md["strings"] == ["", "a b", "你好", "<|im_end|>"] and md["u8s"] == [0, 255]
    assert md["floats"] == [0.5, -2.0] and md["bools"] == [False, True] and md["nested"] == [[1, 2], [3]]
    assert md["general.architecture"] == "tiny"


def test_custom_alignment_and_bad_alignment(tmp_path):
    path = tmp_path / "aligned.gguf"
    writer = gguf.GGUFWriter(path, "tiny")
    writer.add_custom_alignment(64)
    raws = {name: _random_blocks(T.Q8_0, (3, 32), i) for i, name in enumerate(["a", "b"])}  # 102 bytes each
    for name, raw in raws.items():
        writer.add_tensor(name, raw, raw_dtype=T.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile(path)
    assert f.info("a").offset % 64 == 0 and f.info("b").offset - f.info("a").offset == 128
    for name, raw in raws.items():
        assert f.raw(name).numpy().tobytes() == raw.tobytes()
    f.close()
    key = b"general.alignment" + struct.pack("<I", 4)
    _corrupt(path, key + struct.pack("<I", 64), key + struct.pack("<I", 48))
    with pytest.raises(CheckpointError, match="general.alignment is 48, not a power of two"):
        GGUFFile(path)


def test_big_endian_header(tmp_path):
    path = tmp_path / "be.gguf"
    writer = gguf.GGUFWriter(path, "tiny", endianess=gguf.GGUFEndian.BIG)
    writer.add_array("tiny.list", [1, 2, 3])
    writer.add_array("tiny.words", ["x", "yz"])
    writer.add_tensor("w", np.zeros((2, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile(path)
    assert f.version == 3 and f.architecture == "tiny"
    assert f.metadata["tiny.list"] == [1, 2, 3] and f.metadata["tiny.words"] == ["x", "yz"]
    assert (f.info("w").ggml_type, f.info("w").shape, f.info("w").nbytes) == (T.F32, (2, 32), 256)
