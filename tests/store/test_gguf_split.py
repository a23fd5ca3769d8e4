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
