"""The packed store: bit-exact round trip, aligned equal-size extents, checksums that find
the one bad extent, truncated / missing / corrupt files named at open, crash + resume
giving a byte-identical store, and `localmoe verify`."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from click.testing import CliRunner
from safetensors import safe_open

from localmoe.checkpoint import store_spec
from localmoe.commands.verify import command as verify_command
from localmoe.config import ModelSpec
from localmoe.errors import CheckpointError
from localmoe.store.extents import ALIGN, PART_ALIGN
from localmoe.store.manifest import MANIFEST, PROGRESS
from localmoe.store.packed import PackedStore
from localmoe.store.packed_writer import PackedStoreWriter

H, INTER, N_EXPERTS = 64, 96, 5
MXFP4_LAYERS, BF16_LAYERS = (1, 2), (3,)  # layer 0 is dense; layer 3 keeps its experts in bf16
SHARD_BYTES = 16 << 10  # small, so the dense tensors span several shards
SPEC = ModelSpec(model_type="synthetic_moe", family="synthetic", vocab_size=100, hidden_size=H, num_layers=4,
                 num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=INTER, name="synthetic")
DENSE = {  # name -> (dtype, shape); odd shapes and an empty tensor on purpose
    "model.embed_tokens.weight": (torch.bfloat16, (100, H)),
    "model.norm.weight": (torch.float32, (H,)),
    "model.layers.0.mlp.gate_proj.weight": (torch.bfloat16, (INTER, H)),
    "model.layers.0.mlp.down_proj.weight": (torch.bfloat16, (H, INTER)),
    "model.layers.1.input_layernorm.weight": (torch.float32, (H,)),
    "model.layers.1.mlp.gate.weight": (torch.float32, (N_EXPERTS, H)),
    "odd.f32": (torch.float32, (3, 5, 7)),
    "odd.i64": (torch.int64, (13,)),
    "odd.empty": (torch.bfloat16, (0, 4)),
    "lm_head.weight": (torch.bfloat16, (100, H)),
}
RESUME_KEY = "synthetic-v1"


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bits of `dtype` (NaNs included: every comparison is bitwise)."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel()
    raw = torch.randint(0, 256, (max(1, n) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)[:n].reshape(shape).clone()


def dense_tensor(name: str) -> torch.Tensor:
    dtype, shape = DENSE[name]
    return _random(dtype, shape, seed=sorted(DENSE).index(name))


def expert_tensors(layer: int, expert: int) -> dict[str, torch.Tensor]:
    """K3-like MXFP4 experts (packed U8 [out, in/2], scales U8 [out, in/32], a bf16 bias), or bf16 ones."""
    seed = 1000 * layer + 10 * expert
    if layer in BF16_LAYERS:
        return {f"{w}.weight": _random(torch.bfloat16, shape, seed + k)
                for k, (w, shape) in enumerate([("w1", (INTER, H)), ("w3", (INTER, H)), ("w2", (H, INTER))])}
    out = {}
    for k, (w, (rows, cols)) in enumerate([("w1", (INTER, H)), ("w3", (INTER, H)), ("w2", (H, INTER))]):
        out[f"{w}.weight_packed"] = _random(torch.uint8, (rows, cols // 2), seed + 2 * k)
        out[f"{w}.weight_scale"] = _random(torch.uint8, (rows, cols // 32), seed + 2 * k + 1)
    out["w2.bias"] = _random(torch.bfloat16, (H,), seed + 9)
    return out


class Crash(Exception):
    pass


def convert(dst: Path, *, crash_at: tuple[int, int] | None = None, kill_at: tuple[int, int] | None = None,
            loaded: list[str] | None = None, resume_key: str = RESUME_KEY, **kwargs) -> PackedStoreWriter:
    """A converter as `localmoe convert` would drive the writer: lazy dense tensors, layer skipping."""
    loaded = [] if loaded is None else loaded

    def load(name: str) -> torch.Tensor:
        loaded.append(name)
        return dense_tensor(name)

    with PackedStoreWriter(dst, resume_key=resume_key, shard_bytes=SHARD_BYTES, **kwargs) as w:
        w.set_spec(SPEC)
        w.add_file_bytes(b'{"model": {"type": "BPE"}}', "tokenizer.json", "tokenizer")
        w.add_file_bytes(b'{"chat_template": "{{ messages }}"}', "tokenizer_config.json", "tokenizer_config")
        for name, (dtype, shape) in DENSE.items():
            w.add_dense_lazy(name, dtype, shape, lambda name=name: load(name))
        for layer in (*MXFP4_LAYERS, *BF16_LAYERS):
            if w.layer_done(layer):
                continue
            for e in range(N_EXPERTS):
                if kill_at == (layer, e):
                    os.kill(os.getpid(), signal.SIGKILL)
                if crash_at == (layer, e):
                    raise Crash
                w.add_expert(layer, e, expert_tensors(layer, e))
    return w


def _contents(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return convert(tmp_path_factory.mktemp("store") / "synthetic.lmoe").dst


@pytest.fixture
def store_copy(built, tmp_path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "copy.lmoe"))


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x40]))


# ---- round trip and layout ----

def test_round_trip_is_bit_exact(built):
    with PackedStore(built) as store:
        assert store_spec(store) == SPEC
        assert sorted(store.dense_names()) == sorted(DENSE)
        for name in DENSE:
            got, want = store.dense(name), dense_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(_bits(got), _bits(want)), name
        assert store.layers() == [1, 2, 3]
        for layer in store.layers():
            assert store.experts_in(layer) == list(range(N_EXPERTS))
            for e in range(N_EXPERTS):
                got, want = store.expert(layer, e, verify=True), expert_tensors(layer, e)
                assert list(got) == list(want)
                for name in want:
                    assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
                    assert torch.equal(_bits(got[name]), _bits(want[name])), (layer, e, name)
        assert store.file("tokenizer") == built / "tokenizer.json"
        assert store.file("chat_template") is None
        assert store.verify() == []


def test_extents_are_aligned_equal_slots_and_one_read_per_expert(built):
    with PackedStore(built) as store:
        layouts = {layer: store.layout(layer) for layer in store.layers()}
        assert layouts[1] == layouts[2] != layouts[3]  # shared layout, stored once
        assert len(json.loads((built / MANIFEST).read_text())["expert_layouts"]) == 2
        for layer, layout in layouts.items():
            assert layout.slot_bytes % ALIGN == 0 and layout.payload_bytes <= layout.slot_bytes
            assert all(p.offset % PART_ALIGN == 0 for p in layout.parts)
            extents = [store.expert_extent(layer, e) for e in store.experts_in(layer)]
            assert {x.nbytes for x in extents} == {layout.slot_bytes}
            assert all(x.offset % ALIGN == 0 for x in extents)
            assert extents[0].path.stat().st_size == N_EXPERTS * layout.slot_bytes
            # one read of the extent holds every tensor of the expert at its layout offset
            x = extents[3]
            with open(x.path, "rb") as f:
                f.seek(x.offset)
                raw = f.read(x.nbytes)
            assert xxhash.xxh3_64_intdigest(raw) == x.checksum
            for p in layout.parts:
                want = expert_tensors(layer, 3)[p.name]
                assert raw[p.offset:p.offset + p.nbytes] == _bits(want).numpy().tobytes(), p.name
            assert raw[layout.payload_bytes:] == bytes(layout.slot_bytes - layout.payload_bytes)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_an_extent_is_one_o_direct_read(built):
    with PackedStore(built) as store:
        x = store.expert_extent(2, 4)
        views = store.layout(2).views
    try:
        fd = os.open(x.path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        pytest.skip(f"the test file system refuses O_DIRECT ({e})")
    buf = mmap.mmap(-1, x.nbytes)  # page-aligned, as O_DIRECT needs
    try:
        assert os.preadv(fd, [buf], x.offset) == x.nbytes
    except OSError as e:
        pytest.skip(f"the test file system refuses O_DIRECT reads ({e})")
    finally:
        os.close(fd)
    assert xxhash.xxh3_64_intdigest(buf) == x.checksum
    got = views(np.frombuffer(buf, dtype=np.uint8))
    assert torch.equal(_bits(got["w1.weight_packed"]), _bits(expert_tensors(2, 4)["w1.weight_packed"]))


def test_views_are_zero_copy_and_copy_on_write(built):
    with PackedStore(built) as store:
        parts = store.expert(1, 2)
        layout = store.layout(1)
        base = parts[layout.parts[0].name].data_ptr()
        assert [t.data_ptr() - base for t in parts.values()] == [p.offset for p in layout.parts]
        assert store.dense("model.norm.weight").data_ptr() == store.dense("model.norm.weight").data_ptr()
        parts["w2.bias"].zero_()  # private pages: the file is untouched
    with PackedStore(built) as store:
        assert torch.equal(_bits(store.expert(1, 2)["w2.bias"]), _bits(expert_tensors(1, 2)["w2.bias"]))
    assert parts["w1.weight_packed"].sum() >= 0  # the map outlives the store


def test_dense_shards_are_standard_safetensors_within_the_size_limit(built):
    shards = json.loads((built / MANIFEST).read_text())["dense"]["shards"]
    assert len(shards) > 2 and [s["file"] for s in shards] == [f"dense-{i:05d}.safetensors"
                                                                for i in range(1, len(shards) + 1)]
    for shard in shards:
        path = built / shard["file"]
        with safe_open(str(path), "pt") as f:
            names = list(f.keys())
            sizes = [f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in names]
            for n in names:
                assert torch.equal(_bits(f.get_tensor(n)), _bits(dense_tensor(n))), n
        assert len(names) == 1 or sum(sizes) <= SHARD_BYTES
        (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
        assert (8 + header_len) % ALIGN == 0


def test_verify_progress_adds_up_to_total_bytes(built):
    seen = []
    with PackedStore(built) as store:
        assert store.verify(progress=seen.append) == []
        assert sum(seen) == store.total_bytes()


# ---- corruption ----

def test_one_flipped_byte_is_reported_as_exactly_that_expert(store_copy):
    with PackedStore(store_copy) as store:
        x = store.expert_extent(2, 3)
        payload = store.layout(2).payload_bytes
    _flip(x.path, x.offset + payload // 2)
    with PackedStore(store_copy) as store:
        problems = store.verify()
        assert [(p.layer, p.expert, p.offset) for p in problems] == [(2, 3, x.offset)]
        assert str(problems[0]) == f"layer 2 expert 3 in experts/layer-0002.bin at offset {x.offset}: checksum mismatch"
        with pytest.raises(CheckpointError, match="layer 2 expert 3 in experts/layer-0002.bin at offset"):
            store.expert(2, 3, verify=True)
        store.expert(2, 3)  # unverified reads still work
        store.expert(2, 4, verify=True)


def test_padding_and_dense_corruption_are_found(store_copy):
    with PackedStore(store_copy) as store:
        x = store.expert_extent(3, 0)
    _flip(x.path, x.offset + x.nbytes - 1)  # the zero padding is hashed too
    _flip(store_copy / "dense-00002.safetensors", 5000)
    with PackedStore(store_copy) as store:
        assert [str(p) for p in store.verify()] == [
            "dense-00002.safetensors: checksum mismatch",
            f"layer 3 expert 0 in experts/layer-0003.bin at offset {x.offset}: checksum mismatch"]


@pytest.mark.parametrize("file", ["experts/layer-0002.bin", "dense-00001.safetensors", "tokenizer.json"])
def test_truncation_is_found_at_open_naming_the_file(store_copy, file):
    path = store_copy / file
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(CheckpointError, match=rf"{file} is truncated: manifest.json needs at least"):
        PackedStore(store_copy)


@pytest.mark.parametrize("file", ["experts/layer-0001.bin", "dense-00003.safetensors", "tokenizer_config.json"])
def test_missing_file_is_found_at_open(store_copy, file):
    (store_copy / file).unlink()
    with pytest.raises(CheckpointError, match=rf"{file} is missing from the packed store"):
        PackedStore(store_copy)


@pytest.mark.parametrize("edit, message", [
    (lambda text: text[:-30], "not valid JSON"),
    (lambda text: text.replace('"localmoe-packed-store"', '"other"'), "format is 'other'"),
    (lambda text: text.replace('"version": 1', '"version": 2'), "version 2, newer than this localmoe reads"),
    (lambda text: text.replace('"experts": [', '"not_experts": ['), "field 'experts' is missing"),
    (lambda text: text.replace('"layout": "layout-0"', '"layout": "nope"'), r"experts\[0\] needs"),
    (lambda text: text.replace('"slot_bytes": ', '"slot_bytes": 1', 1), "slot_bytes"),
], ids=["truncated-json", "format", "version", "no-experts", "unknown-layout", "bad-slot"])
def test_corrupt_manifest_is_named(store_copy, edit, message):
    path = store_copy / MANIFEST
    path.write_text(edit(path.read_text()))
    with pytest.raises(CheckpointError, match=message) as info:
        PackedStore(store_copy)
    assert str(path) in str(info.value)


def test_a_corrupt_model_spec_is_named(store_copy):
    path = store_copy / MANIFEST
    path.write_text(path.read_text().replace('"vocab_size": 100,', ""))
    with PackedStore(store_copy) as store, pytest.raises(CheckpointError, match="model_spec is not a valid ModelSpec") \
            as info:
        store_spec(store)
    assert str(path) in str(info.value)


def test_a_bad_checksum_field_and_a_non_store_are_named(store_copy, tmp_path):
    doc = json.loads((store_copy / MANIFEST).read_text())
    doc["experts"][1]["xxh3_64"][2] = "xyz"
    (store_copy / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"experts\[1\] \(layer 2\) needs distinct expert ids"):
        PackedStore(store_copy)
    with pytest.raises(CheckpointError, match="is not a packed store: it has no manifest.json"):
        PackedStore(tmp_path)
    with pytest.raises(CheckpointError, match="no such packed store directory"):
        PackedStore(tmp_path / "absent")


# ---- atomicity and resume ----

def test_crash_then_resume_gives_a_byte_identical_store(built, tmp_path):
    dst = tmp_path / "resumed.lmoe"
    with pytest.raises(Crash):
        convert(dst, crash_at=(2, 3))
    assert not (dst / MANIFEST).exists() and (dst / PROGRESS).exists()
    assert (dst / "experts/layer-0002.bin.partial").exists()
    with pytest.raises(CheckpointError, match="did not finish"):
        PackedStore(dst)
    loaded: list[str] = []
    w = PackedStoreWriter(dst, resume_key=RESUME_KEY, shard_bytes=SHARD_BYTES)
    assert w.layer_done(1) and not w.layer_done(2) and w.dense_shard_done(0)
    kept = [name for name in DENSE if w.dense_done(name)]
    w.abandon()
    convert(dst, loaded=loaded)
    assert kept and sorted(loaded) == sorted(set(DENSE) - set(kept))  # kept shards are not reloaded
    assert _contents(dst) == _contents(built)


def test_sigkill_mid_layer_then_resume_gives_a_byte_identical_store(built, tmp_path):
    dst = tmp_path / "killed.lmoe"
    script = (f"import importlib.util, sys; from pathlib import Path\n"
              f"spec = importlib.util.spec_from_file_location('t', {str(Path(__file__))!r})\n"
              f"m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
              f"m.convert(Path({str(dst)!r}), kill_at=(3, 2))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert not (dst / MANIFEST).exists() and (dst / "experts/layer-0003.bin.partial").exists()
    w = PackedStoreWriter(dst, resume_key=RESUME_KEY, shard_bytes=SHARD_BYTES)
    assert w.layer_done(1) and w.layer_done(2) and not w.layer_done(3)
    assert not (dst / "experts/layer-0003.bin.partial").exists()  # stale partial files are removed
    w.abandon()
    w = convert(dst)
    assert _contents(dst) == _contents(built)
    assert w.layer_done(3)


def test_another_resume_key_starts_over(built, tmp_path):
    dst = tmp_path / "rekeyed.lmoe"
    with pytest.raises(Crash):
        convert(dst, crash_at=(3, 0))
    w = PackedStoreWriter(dst, resume_key="synthetic-v2", shard_bytes=SHARD_BYTES)
    assert not w.layer_done(1) and not w.dense_shard_done(0)
    assert not (dst / PROGRESS).exists()  # the old journal must not vouch for files this run replaces
    w.abandon()
    convert(dst, resume_key="synthetic-v2")
    assert _contents(dst) == _contents(built)


def test_an_existing_store_is_kept_unless_overwrite(built, tmp_path):
    dst = Path(shutil.copytree(built, tmp_path / "old.lmoe"))
    with pytest.raises(CheckpointError, match="already holds a packed store"):
        PackedStoreWriter(dst)
    (dst / "experts/layer-0007.bin").write_bytes(b"left by an older conversion")
    convert(dst, overwrite=True)
    assert _contents(dst) == _contents(built)


def test_writer_rejects_experts_that_do_not_fit_the_layer(tmp_path):
    w = PackedStoreWriter(tmp_path / "bad.lmoe")
    w.add_expert(1, 0, expert_tensors(1, 0))
    wrong = expert_tensors(1, 1)
    wrong["w3.weight_scale"] = wrong["w3.weight_scale"][:, :1]
    with pytest.raises(CheckpointError, match=r"layer 1 expert 1 tensor 'w3.weight_scale' is U8 \[96, 1\]"):
        w.add_expert(1, 1, wrong)
    with pytest.raises(CheckpointError, match="layer 1 expert 2 has tensors that differ"):
        w.add_expert(1, 2, {**expert_tensors(1, 2), "extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="added twice"):
        w.add_expert(1, 0, expert_tensors(1, 0))
    w.add_expert(2, 0, expert_tensors(2, 0))
    with pytest.raises(ValueError, match="already written"):
        w.add_expert(1, 3, expert_tensors(1, 3))
    w.abandon()


def test_next_n_layers_hold_experts_past_the_models_layers(tmp_path):
    """A checkpoint's MTP layers follow its num_layers (ModelSpec.nextn_layers): the writer and the manifest take
    their experts as extents (layer 4 of a 4-layer model with one MTP layer), and refuse layers past them."""
    import dataclasses

    w = PackedStoreWriter(tmp_path / "mtp.lmoe")
    w.set_spec(dataclasses.replace(SPEC, nextn_layers=1))
    for e in range(2):
        w.add_expert(4, e, expert_tensors(1, e))
    with PackedStore(w.finish()) as store:
        assert store.layers() == [4] and store.experts_in(4) == [0, 1]
        assert not store.verify()
        x = store.expert_extent(4, 1)
    _flip(x.path, x.offset + 3)
    with PackedStore(tmp_path / "mtp.lmoe") as store:
        assert [(p.layer, p.expert) for p in store.verify()] == [(4, 1)]
    manifest = tmp_path / "mtp.lmoe" / MANIFEST
    doc = json.loads(manifest.read_text())
    doc["model_spec"]["nextn_layers"] = 0
    manifest.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="lists layer 4, past the model's layers"):
        PackedStore(tmp_path / "mtp.lmoe")
    w = PackedStoreWriter(tmp_path / "beyond.lmoe")
    w.set_spec(dataclasses.replace(SPEC, nextn_layers=1))
    w.add_expert(5, 0, expert_tensors(1, 0))
    with pytest.raises(ValueError, match=r"experts of layers \[5\] are past the model's 4 layers and 1 MTP"):
        w.finish()


def test_extra_files_are_copied_and_found_by_role(tmp_path):
    src = tmp_path / "tokenizer.json"
    src.write_bytes(b'{"added_tokens": []}' * 5000)
    w = PackedStoreWriter(tmp_path / "files.lmoe")
    w.set_spec(SPEC)
    w.add_file(src, "tokenizer.json", role="tokenizer")
    w.add_file_bytes(b"{{ messages }}", "chat_template.jinja", role="chat_template")
    for bad in ["../x", "experts", "manifest.json", ".progress.json", "dense-00001.safetensors"]:
        with pytest.raises(ValueError, match="cannot be an extra file's name"):
            w.add_file_bytes(b"", bad)
    with PackedStore(w.finish()) as store:
        assert store.file("tokenizer").read_bytes() == src.read_bytes()
        assert store.file("chat_template").read_text() == "{{ messages }}"
        assert store.layers() == [] and store.dense_names() == [] and store.verify() == []


# ---- the CLI ----

def test_verify_command_exit_codes_and_messages(store_copy):
    runner = CliRunner()
    ok = runner.invoke(verify_command, [str(store_copy)])
    assert ok.exit_code == 0 and ok.stdout.startswith(f"OK: {store_copy}: 15 experts, 10 dense tensors")
    with PackedStore(store_copy) as store:
        x = store.expert_extent(1, 4)
    _flip(x.path, x.offset + 10)
    bad = runner.invoke(verify_command, [str(store_copy)])
    assert bad.exit_code == 1
    assert bad.stdout == f"layer 1 expert 4 in experts/layer-0001.bin at offset {x.offset}: checksum mismatch\n"
    assert "1 problem(s)" in bad.stderr
    os.truncate(x.path, x.offset)
    cut = runner.invoke(verify_command, [str(store_copy)])
    assert cut.exit_code == 1 and cut.stdout == ""
    assert cut.stderr.startswith("localmoe: error: ") and "experts/layer-0001.bin is truncated" in cut.stderr
