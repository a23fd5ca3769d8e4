"""`localmoe convert`: every generated family converts with dense tensors bit-exact, MXFP4
experts repacked bit-exact, bf16 experts quantised within the MXFP4 bound with the error
reported exactly (or kept bit-exact); the SmolLM2 GGUF keeps its raw blocks; a conversion
killed with SIGKILL resumes to a byte-identical store; peak RSS stays near the largest
tensor, far below the checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import xxhash
from click.testing import CliRunner
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file

from localmoe.checkpoint import open_checkpoint, store_spec
from localmoe.commands.convert import command as convert_command
from localmoe.commands.verify import command as verify_command
from localmoe.convert import ERRORS_JOURNAL, convert
from localmoe.convert.sources import HF_FILES
from localmoe.errors import CheckpointError
from localmoe.models import family_for_model_type
from localmoe.quant import mxfp4
from localmoe.quant.ggml import dequantize as ggml_dequantize
from localmoe.store.gguf import GGUFFile
from localmoe.store.manifest import MANIFEST, PROGRESS
from localmoe.store.packed import PackedStore
from localmoe.store.safetensors import SafetensorsCheckpoint
from localmoe.testing import FAMILIES, write_checkpoint
from localmoe.tokenizer.gguf import tokenizer_from_gguf, tokenizer_from_gguf_metadata
from localmoe.tokenizer.hf import tokenizer_from_hf_dir

BF16_FAMILIES = ("kimi_linear", "qwen3_next", "deepseek_v32", "glm5_next")
MXFP4_FAMILIES = ("kimi_k3", "gpt_oss")
PARTS = [f"{p}.{k}" for p in ("gate", "up", "down") for k in ("packed", "scales")]
REPO = Path(__file__).resolve().parents[2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _digests(root: Path) -> dict[str, str]:
    """Every file under `root` -> its xxh3 (streamed: stores here are hundreds of MB)."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h = xxhash.xxh3_64()
        with open(path, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
        out[path.relative_to(root).as_posix()] = h.hexdigest()
    return out


def _config(src: Path) -> dict:
    return json.loads((src / "config.json").read_text())


def _decl(src: Path):
    return family_for_model_type(_config(src)["model_type"]).experts


def _report(store: PackedStore) -> dict:
    return json.loads(store.file("conversion_report").read_text())


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(family, experts) -> (source dir, store dir), each converted once per module."""
    root = tmp_path_factory.mktemp("convert")
    done: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(family: str, experts: str = "mxfp4") -> tuple[Path, Path]:
        if (family, experts) not in done:
            src = root / "src" / family
            if not src.exists():
                write_checkpoint(family, src, size="tiny", seed=0)
            dst = root / f"{family}-{experts}.lmoe"
            convert(src, dst, experts=experts)
            done[family, experts] = (src, dst)
        return done[family, experts]

    return get


# ---- every family: dense tensors, files, spec ----

@pytest.mark.parametrize("family", list(FAMILIES))
def test_dense_tensors_files_and_spec_are_copied_unchanged(tiny, family):
    src, dst = tiny(family)
    expert = _decl(src).matcher()
    opened = open_checkpoint(src)  # its tensor names leave an appended MTP layer out (glm4_moe has one)
    mtp = set(SafetensorsCheckpoint(src).keys()) - set(opened.tensor_names)
    assert bool(mtp) == bool(opened.spec.nextn_layers) and all(".layers.3." in n for n in mtp)
    opened.close()
    with SafetensorsCheckpoint(src) as ckpt, PackedStore(dst) as store:
        # the MTP layer is kept (read only for --spec mtp), its routed experts as extents like any layer's
        dense = [n for n in ckpt.keys() if not expert.match(n)]  # noqa: SIM118 - keys() is a method
        assert sorted(store.dense_names()) == sorted(dense)
        for name in dense:
            assert _same(store.dense(name), ckpt.tensor(name)), name
        for name, role in HF_FILES.items():
            if (src / name).exists():
                assert store.file(role).read_bytes() == (src / name).read_bytes(), name
        spec = store_spec(store)
        assert spec == family_for_model_type(_config(src)["model_type"]).spec_from_hf(_config(src))
        assert store.layers() == spec.moe_layers() + [spec.num_layers + k for k in range(spec.nextn_layers)]
        assert all(store.experts_in(layer) == list(range(spec.num_experts)) for layer in store.layers())
        assert store.verify() == []


def test_the_store_is_a_tokenizer_directory(tiny):
    src, dst = tiny("gpt_oss")  # its chat template is in chat_template.jinja
    a, b = tokenizer_from_hf_dir(src), tokenizer_from_hf_dir(dst)
    text = "Hello, world! 1234"
    messages = [{"role": "user", "content": "hi"}]
    assert a.encode(text) == b.encode(text)
    assert a.apply_chat_template(messages) == b.apply_chat_template(messages)


# ---- MXFP4 sources: repacked, never requantised ----

def test_kimi_k3_experts_are_repacked_bit_exactly(tiny):
    """K3's compressed-tensors layout is the canonical one: the inverse repack is the identity."""
    src, dst = tiny("kimi_k3")
    decl = _decl(src)
    with SafetensorsCheckpoint(src) as ckpt, PackedStore(dst) as store:
        assert _report(store)["experts"] | {"layers": None} == {
            "source_format": "compressed_tensors_mxfp4", "stored": "mxfp4-repacked", "lossless": True,
            "layers": None, "experts_per_layer": 16, "source_nbytes": _report(store)["experts"]["source_nbytes"]}
        for layer in store.layers():
            assert store.layout(layer).names() == PARTS
            for e in store.experts_in(layer):
                got = store.expert(layer, e, verify=True)
                for proj in ("gate", "up", "down"):
                    packed, scales = (ckpt.tensor(n) for n in decl.tensor_names(layer, e, proj))
                    assert _same(got[f"{proj}.packed"], packed) and _same(got[f"{proj}.scales"], scales)
                    assert torch.equal(mxfp4.dequantize(got[f"{proj}.packed"], got[f"{proj}.scales"]),
                                       mxfp4.dequantize(packed, scales))


def test_gpt_oss_experts_are_sliced_split_and_repacked_bit_exactly(tiny):
    src, dst = tiny("gpt_oss")
    with SafetensorsCheckpoint(src) as ckpt, PackedStore(dst) as store:
        for layer in store.layers():
            assert store.layout(layer).names() == ["gate.packed", "gate.scales", "gate.bias", "up.packed",
                                                   "up.scales", "up.bias", "down.packed", "down.scales",
                                                   "down.bias"]
            p = f"model.layers.{layer}.mlp.experts."
            for e in store.experts_in(layer):
                got = store.expert(layer, e, verify=True)
                blocks, scales, bias = (ckpt.tensor(p + f"gate_up_proj_{k}")[e] for k in ("blocks", "scales", "bias"))
                # the inverse repack gives back the source bytes
                packed, sc = mxfp4.interleave_gate_up((got["gate.packed"], got["gate.scales"]),
                                                      (got["up.packed"], got["up.scales"]))
                back_blocks, back_scales = mxfp4.canonical_to_gpt_oss(packed, sc)
                assert _same(back_blocks, blocks) and _same(back_scales, scales)
                assert _same(torch.stack([got["gate.bias"], got["up.bias"]], dim=-1).reshape(-1), bias)
                # and the values are the source's
                values = mxfp4.dequantize(*mxfp4.gpt_oss_to_canonical(blocks, scales))
                assert torch.equal(mxfp4.dequantize(got["gate.packed"], got["gate.scales"]), values[0::2])
                assert torch.equal(mxfp4.dequantize(got["up.packed"], got["up.scales"]), values[1::2])
                blocks, scales, bias = (ckpt.tensor(p + f"down_proj_{k}")[e] for k in ("blocks", "scales", "bias"))
                assert _same(mxfp4.canonical_to_gpt_oss(got["down.packed"], got["down.scales"])[0], blocks)
                assert _same(got["down.scales"], scales) and _same(got["down.bias"], bias)


@pytest.mark.parametrize("family", MXFP4_FAMILIES)
def test_keep_changes_nothing_for_mxfp4_sources(tiny, family):
    _, a = tiny(family)
    _, b = tiny(family, "keep")
    da, db = _digests(a), _digests(b)
    layers = [f for f in da if f.startswith(("experts/", "dense-"))]
    assert layers and all(da[f] == db[f] for f in layers)


# ---- bf16 sources: quantised within the bound, error reported exactly; or kept ----

def _within_mxfp4_bound(x: torch.Tensor, x_hat: torch.Tensor) -> bool:
    """docs/mxfp4.md: |x_hat - x| <= max(|x| / 5, amax / 14, 2^-129) under the midpoint rule."""
    x, x_hat = x.double(), x_hat.double()
    amax = x.abs().reshape(-1, 32).amax(dim=1).repeat_interleave(32).reshape(x.shape)
    bound = torch.maximum(torch.maximum(x.abs() / 5, amax / 14), torch.tensor(2.0 ** -129, dtype=torch.float64))
    return bool(((x_hat - x).abs() <= bound).all())


def _check_quantised(store: PackedStore, source_weight) -> None:
    """Every expert within the bound of `source_weight(layer, e, proj)`, and its reported
    error equal to mxfp4.quantization_error recomputed from the store's bytes."""
    report = _report(store)
    assert report["experts"]["stored"] == "mxfp4-quantized" and not report["experts"]["lossless"]
    records = {r["layer"]: r for r in report["quantization"]["layers"]}
    assert sorted(records) == store.layers()
    relative = []
    for layer in store.layers():
        assert store.layout(layer).names() == PARTS
        record = records[layer]
        assert record["experts"] == store.experts_in(layer)
        for i, e in enumerate(store.experts_in(layer)):
            got = store.expert(layer, e, verify=True)
            for proj in ("gate", "up", "down"):
                x, packed, scales = source_weight(layer, e, proj), got[f"{proj}.packed"], got[f"{proj}.scales"]
                assert _within_mxfp4_bound(x, mxfp4.dequantize(packed, scales)), (layer, e, proj)
                assert _same(packed, mxfp4.quantize(x)[0])  # deterministic: the default rule
                error = mxfp4.quantization_error(x, packed, scales)
                assert {k: record["tensors"][proj][k][i] for k in error} == error, (layer, e, proj)
                relative.append(error["relative_rmse"])
    summary = report["quantization"]["summary"]
    assert summary["num_tensors"] == len(relative) and summary["max_relative_rmse"] == max(relative)
    assert summary["mean_relative_rmse"] == pytest.approx(sum(relative) / len(relative), rel=1e-12)
    assert 0.05 < summary["mean_relative_rmse"] < 0.13  # docs/mxfp4.md: ~0.11 on uniform-ish weights


@pytest.mark.parametrize("family", BF16_FAMILIES)
def test_bf16_experts_are_quantised_within_the_bound_and_the_error_is_reported(tiny, family):
    src, dst = tiny(family)
    decl = _decl(src)
    with SafetensorsCheckpoint(src) as ckpt, PackedStore(dst) as store:
        _check_quantised(store, lambda layer, e, proj: ckpt.tensor(decl.tensor_names(layer, e, proj)[0]))


@pytest.mark.parametrize("family", BF16_FAMILIES)
def test_keep_stores_bf16_experts_bit_exactly(tiny, family):
    src, dst = tiny(family, "keep")
    decl = _decl(src)
    with SafetensorsCheckpoint(src) as ckpt, PackedStore(dst) as store:
        report = _report(store)
        assert report["experts"]["stored"] == "kept" and "quantization" not in report
        for layer in store.layers():
            assert store.layout(layer).names() == ["gate.weight", "up.weight", "down.weight"]
            for e in store.experts_in(layer):
                got = store.expert(layer, e, verify=True)
                for proj in ("gate", "up", "down"):
                    assert _same(got[f"{proj}.weight"], ckpt.tensor(decl.tensor_names(layer, e, proj)[0]))


def _fp8_copy(src: Path, dst: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`src` with its routed experts in FP8 E4M3 plus DeepSeek's 128x128 `weight_scale_inv`."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    expert = _decl(src).matcher()
    fp8 = {}
    for name in [n for n in tensors if expert.match(n)]:
        w = tensors[name].float()
        scale = (w.abs().amax() / 448).clamp(min=1e-12).reshape(1, 1)  # one block: tiny shapes are < 128
        fp8[name] = ((w / scale).to(torch.float8_e4m3fn), scale)
        tensors[name], tensors[name + "_scale_inv"] = fp8[name]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return fp8


def test_fp8_experts_with_block_scales_are_dequantised_then_quantised_or_kept(tiny, tmp_path):
    src, _ = tiny("deepseek_v32")
    fp8 = _fp8_copy(src, tmp_path / "fp8")
    decl = _decl(src)
    convert(tmp_path / "fp8", tmp_path / "q.lmoe")
    convert(tmp_path / "fp8", tmp_path / "k.lmoe", experts="keep")

    def weight(layer, e, proj):
        q, scale = fp8[decl.tensor_names(layer, e, proj)[0]]
        return q.float() * scale

    with PackedStore(tmp_path / "q.lmoe") as store:
        assert not any(n.endswith("_scale_inv") for n in store.dense_names())
        _check_quantised(store, weight)
    with PackedStore(tmp_path / "k.lmoe") as store:
        layer = store.layers()[0]
        got = store.expert(layer, 3, verify=True)
        q, scale = fp8[decl.tensor_names(layer, 3, "up")[0]]
        assert _same(got["up.weight"], q) and _same(got["up.weight_scale_inv"], scale)


# ---- GGUF ----

def test_smollm2_gguf_keeps_its_raw_blocks_metadata_and_tokenizer(smollm2_gguf, tmp_path):
    convert(smollm2_gguf, tmp_path / "smol.lmoe")
    with GGUFFile(smollm2_gguf) as gguf, PackedStore(tmp_path / "smol.lmoe") as store:
        names = gguf.tensor_names()
        assert sorted(store.dense_names()) == sorted(names) and store.layers() == []
        types = json.loads(store.file("gguf_tensors").read_text())["tensors"]
        for name in names:
            info, stored = gguf.info(name), store.dense(name)
            assert torch.equal(_bits(stored), gguf.raw(name).reshape(-1)), name
            assert types[name]["ggml_type"] == info.ggml_type.name and tuple(types[name]["shape"]) == info.shape
            if info.ggml_type == GGMLQuantizationType.F32:
                assert stored.dtype == torch.float32 and tuple(stored.shape) == info.shape
        for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.3.ffn_norm.weight"):  # Q8_0, Q4_1, F32
            t = types[name]
            assert torch.equal(ggml_dequantize(store.dense(name), GGMLQuantizationType[t["ggml_type"]], t["shape"]),
                               gguf.tensor(name))
        metadata = json.loads(store.file("gguf_metadata").read_text())
        assert metadata == json.loads(json.dumps(gguf.metadata))
        text = "<|im_start|>user\nHello, world! 1234<|im_end|>"
        assert tokenizer_from_gguf_metadata(metadata, "store").encode(text) == \
            tokenizer_from_gguf(smollm2_gguf).encode(text)
        assert store.file("chat_template").read_text() == gguf.metadata["tokenizer.chat_template"]
        assert store.manifest.model_spec["model_type"] == "llama" and store_spec(store).num_layers == 30
        assert store.verify() == []


# ---- resume, errors ----

class Stop(Exception):
    pass


@pytest.mark.parametrize("lose_journal", [False, True], ids=["journalled", "journal-lost"])
def test_an_interrupted_quantising_conversion_resumes_to_the_same_bytes(tiny, tmp_path, lose_journal):
    src, reference = tiny("kimi_linear")
    dst = tmp_path / "resumed.lmoe"

    def stop(done: int, total: int) -> None:
        if (dst / "experts/layer-0001.bin").exists():  # layer 1 is finished and journalled
            raise Stop

    with pytest.raises(Stop):
        convert(src, dst, progress=stop)
    assert not (dst / MANIFEST).exists() and (dst / PROGRESS).exists() and (dst / ERRORS_JOURNAL).exists()
    if lose_journal:  # as if killed between finishing layer 1 and journalling its error
        (dst / ERRORS_JOURNAL).unlink()
    logs: list[str] = []
    convert(src, dst, log=logs.append)
    assert any("measuring its quantisation error again" in line for line in logs) == lose_journal
    assert not any(line.startswith("layer 1:") and "quantised" in line for line in logs)  # layer 1 was kept
    assert _digests(dst) == _digests(reference)


def test_errors_name_the_file_and_the_tensor(tiny, tmp_path):
    src, dst = tiny("kimi_k3")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tensors = load_file(src / "model.safetensors")
    missing = "language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight_scale"
    del tensors[missing]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{broken}.*{missing.replace('.', '[.]')}.*missing"):
        convert(broken, tmp_path / "x.lmoe")
    copy = tmp_path / "copy.lmoe"
    shutil.copytree(dst, copy)
    with pytest.raises(CheckpointError, match="already holds a packed store; pass --overwrite"):
        convert(src, copy)
    before = _digests(copy)
    convert(src, copy, overwrite=True)
    assert _digests(copy) == before
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty and not a packed store"):
        convert(src, tmp_path / "junk")
    (tmp_path / "fake.gguf").write_bytes(b"not a model")
    result = CliRunner().invoke(convert_command, [str(tmp_path / "fake.gguf"), str(tmp_path / "y.lmoe")])
    assert result.exit_code == 1 and "localmoe: error:" in result.stderr and "is not a GGUF file" in result.stderr


# ---- a small checkpoint in a subprocess: peak RSS, SIGKILL + resume, verify ----

def _convert_command(src: Path, dst: Path) -> list[str]:
    # --experts keep: a byte copy, so the test spends its time on I/O rather than quantising
    return [sys.executable, "-m", "localmoe", "convert", str(src), str(dst), "--experts", "keep"]


_PEAK_RSS = """import os, runpy, sys
try:
    {body}
finally:
    with open('/proc/self/status') as f:  # VmHWM: this process's peak RSS since exec
        peak = next(line for line in f if line.startswith('VmHWM:'))
    with open(os.environ['PEAK_RSS_FILE'], 'w') as f:
        f.write(str(int(peak.split()[1]) * 1024))
"""


def _peak_rss(body: str, args: list[str], tmp: Path) -> int:
    """Peak RSS in bytes of a child running `body` with `args`. Read from the child's own
    /proc/self/status: wait4's ru_maxrss would count the pytest process the child forked from."""
    out = tmp / "peak-rss"
    proc = subprocess.run([sys.executable, "-c", _PEAK_RSS.format(body=body), *args], cwd=REPO, timeout=300,
                          check=False, env={**os.environ, "PEAK_RSS_FILE": str(out)}, capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()
    return int(out.read_text())


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A `small` kimi_linear (0.55 GB) and its store converted in a subprocess, with peak RSS."""
    root = tmp_path_factory.mktemp("small")
    src = write_checkpoint("kimi_linear", root / "src", size="small", seed=0)
    baseline = _peak_rss("import localmoe.cli, localmoe.convert, tqdm", [], root)
    peak = _peak_rss("runpy.run_module('localmoe', run_name='__main__', alter_sys=True)",
                     _convert_command(src, root / "reference.lmoe")[3:], root)
    return src, root / "reference.lmoe", baseline, peak


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_peak_rss_stays_near_the_largest_tensor(small):
    src, _, baseline, peak = small
    with SafetensorsCheckpoint(src) as ckpt:
        largest = max(ckpt.info(n).nbytes for n in ckpt.keys())  # noqa: SIM118 - not iterable, keys() is a method
        size = sum((src / f).stat().st_size for f in ckpt.files)
    print(f"\ncheckpoint {size / 2**20:.0f} MiB, largest tensor {largest / 2**20:.0f} MiB, peak RSS "
          f"{peak / 2**20:.0f} MiB (imports alone: {baseline / 2**20:.0f} MiB)")
    bound = baseline + largest + (64 << 20)  # the imports, one tensor in flight, 64 MiB for the rest
    assert size > bound  # holding the checkpoint (or a good part of it) would fail
    assert peak <= bound


@pytest.mark.slow
def test_sigkill_then_rerun_gives_a_byte_identical_store_and_verify_finds_a_flipped_byte(small, tmp_path):
    src, reference, _, _ = small
    dst = tmp_path / "killed.lmoe"
    proc = subprocess.Popen(_convert_command(src, dst), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (dst / "experts/layer-0001.bin").exists():  # dense shard and MoE layer 1 are done
        assert proc.poll() is None and time.monotonic() < deadline, "the conversion ended before it was killed"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (dst / MANIFEST).exists() and (dst / PROGRESS).exists()
    rerun = subprocess.run(_convert_command(src, dst), cwd=REPO, capture_output=True, timeout=300, check=False)
    assert rerun.returncode == 0, rerun.stderr.decode()
    assert _digests(dst) == _digests(reference)

    runner = CliRunner()
    ok = runner.invoke(verify_command, [str(dst)])
    assert ok.exit_code == 0 and ok.stdout.startswith(f"OK: {dst}: 224 experts")
    with PackedStore(dst) as store:
        extent = store.expert_extent(4, 17)
    _flip(extent.path, extent.offset + 1000)
    bad = runner.invoke(verify_command, [str(dst)])
    assert bad.exit_code == 1
    assert bad.stdout == f"layer 4 expert 17 in experts/layer-0004.bin at offset {extent.offset}: checksum mismatch\n"
