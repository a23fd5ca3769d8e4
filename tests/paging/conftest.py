"""Fixtures for the pager tests: tiny checkpoints, their packed stores, resident references."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from localmoe.convert import convert
from localmoe.load import load_model
from localmoe.store.packed import PackedStore
from localmoe.testing import write_checkpoint

PROMPT = [5, 17, 3, 99, 42, 7, 250, 11]
DECODE = 12


def run_greedy(model, prompt=PROMPT, steps=DECODE):
    """(tokens, logits per step) of a prefill of `prompt` then `steps` greedy decode steps."""
    cache = model.new_cache(1, len(prompt) + steps + 1)
    logits = model.forward(torch.tensor([prompt]), cache, all_logits=True)
    out, tokens = [logits], []
    for _ in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token))
        logits = model.forward(token, cache)
        out.append(logits)
    return tokens, out


class Checkpoint:
    def __init__(self, family: str, root, experts: str):
        self.family = family
        self.src = write_checkpoint(family, root / family, size="tiny", seed=1)
        self.store_path = root / f"{family}.lmoe"
        convert(self.src, self.store_path, experts=experts)
        self.loaded = load_model(self.src, dtype="float32", progress=False)
        self.model = self.loaded.model
        self.resident = [b.experts for b in self.model.moe_blocks()]
        self.tokens, self.logits = run_greedy(self.model)

    def store(self) -> PackedStore:
        return PackedStore(self.store_path)

    def restore(self) -> None:
        """Back to the resident experts and plain routers."""
        from localmoe.paging import detach

        detach(self.model)
        for block, provider in zip(self.model.moe_blocks(), self.resident):
            block.experts = provider


@pytest.fixture(scope="session")
def private_tmp():
    """A directory outside pytest's basetemp (other sessions' pytest runs rotate that one away)."""
    root = Path(tempfile.mkdtemp(prefix="localmoe-paging-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def ckpts(private_tmp):
    root = private_tmp / "ckpts"
    root.mkdir()
    # gpt_oss and kimi_k3 ship MXFP4 (repacked losslessly); kimi_linear's bf16 experts are kept as they are
    return {"gpt_oss": Checkpoint("gpt_oss", root, "mxfp4"), "kimi_linear": Checkpoint("kimi_linear", root, "keep"),
            "kimi_k3": Checkpoint("kimi_k3", root, "mxfp4")}


@pytest.fixture
def gpt_oss(ckpts):
    c = ckpts["gpt_oss"]
    yield c
    c.restore()


@pytest.fixture
def kimi_k3(ckpts):
    c = ckpts["kimi_k3"]
    yield c
    c.restore()


@pytest.fixture
def kimi_linear(ckpts):
    c = ckpts["kimi_linear"]
    yield c
    c.restore()
