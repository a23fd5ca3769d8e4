"""Split GGUFs (`-0000N-of-0000M.gguf`, written by the gguf package's own GGUFWriter): any part opens the
whole model, which equals its unsplit file for run, inspect, convert and verify; a missing, truncated,
renamed or foreign part is named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from localmoe.cli import cli
from localmoe.errors import CheckpointError
from localmoe.load import load_model
from localmoe.store.gguf import GGUFFile
from localmoe.store.gguf_split import GGUFSplit, open_gguf
from localmoe.testing import write_checkpoint
from localmoe.testing.gguf_split import split_gguf
from localmoe.testing.gpt_oss_gguf import write_gguf

PROMPT = torch.tensor([[5, 17, 3, 99, 42, 7, 250, 11]])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_split")
    src = write_checkpoint("gpt_oss", root / "src", size="tiny", seed=2)
    whole = write_gguf(src, root / "tiny.gguf")
    (root / "split").mkdir()
    return whole, split_gguf(whole, root / "split" / "tiny.gguf", 3)


def _logits(path) -> list[torch.Tensor]:
    model = load_model(path, dtype="float32", progress=False).model
    cache = model.new_cache(1, 16)
    out = [model.forward(PROMPT, cache, all_logits=True)]
    for _ in range(3):
        out.append(model.forward(out[-1][:, -1:].argmax(-1), cache))
    return out


def test_any_part_reads_as_the_unsplit_file(files):
    whole, parts = files
    assert [p.name for p in parts] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    single = GGUFFile(whole)
    for part in parts:
        with open_gguf(part) as split:
            assert isinstance(split, GGUFSplit) and split.files == parts
            assert split.metadata == single.metadata  # split.* keys dropped
            assert split.tensor_names() == single.tensor_names()
            owners = {split.file_of(n) for n in split.tensor_names()}
            assert owners == set(parts)  # the tensors really are spread over the three files
            for name in single.tensor_names():
                a, b = single.info(name), split.info(name)
                assert (a.ggml_type, a.shape, a.nbytes) == (b.ggml_type, b.shape, b.nbytes)
                assert torch.equal(single.raw(name), split.raw(name))


def test_run_gives_the_unsplit_files_bits(files):
    whole, parts = files
    for a, b in zip(_logits(parts[2]), _logits(whole)):
        assert torch.equal(a, b)


def test_convert_inspect_and_verify(files, tmp_path):
    from localmoe.convert import convert

    whole, parts = files
    convert(parts[1], tmp_path / "store", progress=False)
    convert(whole, tmp_path / "whole", progress=False)
    for a, b in zip(_logits(tmp_path / "store"), _logits(tmp_path / "whole")):
        assert torch.equal(a, b)
    runner = CliRunner()
    out = runner.invoke(cli, ["inspect", str(parts[0]), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["files"] == [str(p) for p in parts]
    text = runner.invoke(cli, ["inspect", str(parts[0])]).output
    assert "3 parts: tiny-00001-of-00003.gguf ... tiny-00003-of-00003.gguf" in text
    out = runner.invoke(cli, ["verify", str(parts[2])])
    assert out.exit_code == 0 and out.output.startswith(f"OK: {parts[2]}: 3 file(s), ") and \
        f"{sum(p.stat().st_size for p in parts) / 1e6:.1f} MB read" in out.output


def _copy(parts, tmp_path):
    for p in parts:
        shutil.copy(p, tmp_path / p.name)
    return [tmp_path / p.name for p in parts]


def test_missing_part_is_named(files, tmp_path):
    parts = _copy(files[1], tmp_path)
    parts[1].unlink()
    for given in (parts[0], parts[2]):
        with pytest.raises(CheckpointError, match=r"part of a GGUF split into 3 files, and part "
                                                  r"tiny-00002-of-00003\.gguf is missing; download every part"):
            load_model(given, progress=False)
    out = CliRunner().invoke(cli, ["verify", str(parts[0])])
    assert out.exit_code == 1 and "tiny-00002-of-00003.gguf is missing" in out.output


def test_truncated_part_is_named(files, tmp_path):
    parts = _copy(files[1], tmp_path)
    with open(parts[2], "r+b") as f:
        f.truncate(parts[2].stat().st_size - 100)
    with pytest.raises(CheckpointError, match=r"tiny-00003-of-00003\.gguf is truncated: expected at least"):
        open_gguf(parts[0])


def test_renamed_or_foreign_part_is_refused(files, tmp_path):
    parts = _copy(files[1], tmp_path)
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(parts[0], renamed)
    with pytest.raises(CheckpointError, match=r"renamed\.gguf is part 1 of a GGUF split into 3 files, but its name"):
        open_gguf(renamed)
    parts[1].rename(tmp_path / "x")  # parts 1 and 2 swapped: the metadata disagrees with the names
    parts[0].rename(parts[1])
    (tmp_path / "x").rename(parts[0])
    with pytest.raises(CheckpointError, match=r"tiny-00001-of-00003\.gguf: its metadata says part 1 of 3, but its "
                                              r"name says part 0"):
        open_gguf(parts[2])


def test_dequantized_rewrite_computes_the_same_function(tmp_path):
    """`rewrite_gguf(dequantize=("MXFP4",))` (benchmarks/k3_cpu.py's F32 twin of a K3 GGUF): every MXFP4 tensor
    becomes F32 with the values gguf's own dequantiser gives, the others are unchanged, and the twin's logits
    (dense F32 experts) are within 1e-5 of the range of the MXFP4 file's at exact precision."""
    import gguf
    import numpy as np

    from localmoe.testing.gguf_split import rewrite_gguf
    from localmoe.testing.k3_gguf import write_k3_gguf

    whole = write_k3_gguf(write_checkpoint("kimi_k3", tmp_path / "src", size="tiny", seed=2), tmp_path / "k3.gguf")
    (twin,) = rewrite_gguf(whole, tmp_path / "twin.gguf", dequantize=("MXFP4",))
    src = {t.name: t for t in gguf.GGUFReader(whole).tensors}
    out = {t.name: t for t in gguf.GGUFReader(twin).tensors}
    assert src.keys() == out.keys()
    mxfp4 = [n for n, t in src.items() if t.tensor_type == gguf.GGMLQuantizationType.MXFP4]
    assert mxfp4 and not any(t.tensor_type == gguf.GGMLQuantizationType.MXFP4 for t in out.values())
    for name, t in src.items():
        got = out[name]
        if name in mxfp4:
            assert got.tensor_type == gguf.GGMLQuantizationType.F32 and list(got.shape) == list(t.shape)
            want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(np.asarray(got.data).shape)
            assert np.array_equal(np.asarray(got.data), want)
        else:
            assert got.tensor_type == t.tensor_type and np.array_equal(np.asarray(got.data), np.asarray(t.data))

    def logits(path):
        model = load_model(path, dtype="float32", expert_precision="exact", progress=False).model
        cache = model.new_cache(1, 16)
        out = [model.forward(PROMPT, cache, all_logits=True)]
        for _ in range(3):
            out.append(model.forward(out[-1][:, -1:].argmax(-1), cache))
        return out

    for step, (a, b) in enumerate(zip(logits(twin), logits(whole))):
        diff = (a - b).abs().max().item()
        assert diff <= 1e-5 * (b.max() - b.min()).item(), f"step {step}: max diff {diff:.3e}"
