"""Fixtures shared by the engine tests: `model`, the tiny fp32 model of each runnable family in FAMILIES
(module-scoped, parametrized over them; a test module with its own `model` fixture keeps that one), and
`small_blocks` (paged caches shrunk to 16-token blocks so every run crosses blocks; not autouse: a module
takes it with `pytestmark = pytest.mark.usefixtures("small_blocks")`, a test by naming it)."""

from __future__ import annotations

import pytest
import torch

from localmoe.config import EngineConfig
from localmoe.engine import cache as cache_module
from localmoe.load import build_from_tensors, load_model
from localmoe.models import family_for_model_type
from localmoe.testing import write_checkpoint

FAMILIES = ["llama", "gpt_oss", "kimi_linear", "kimi_k3", "qwen3_next"]
SMALL_BLOCK_TOKENS = 16


def _runnable(model_type: str):
    if not family_for_model_type(model_type).runnable:
        pytest.skip(f"{model_type} is not runnable yet (family_for_model_type({model_type!r}).runnable is False)")


def build_model(model_type: str, directory):
    """The tiny fp32 model of a family (Llama: random weights in canonical names; others: a written checkpoint)."""
    config = EngineConfig(dtype="float32", threads=1, expert_precision="exact")
    if model_type == "llama":  # as tests/models/test_llama_tiny.py builds it: transformers' init, norms perturbed
        transformers = pytest.importorskip("transformers")
        hf = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False)
        torch.manual_seed(0)
        reference = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
        tensors = {name: p + 0.2 * torch.randn_like(p) if "norm" in name else p
                   for name, p in reference.state_dict().items()}
        family = family_for_model_type("llama")
        return build_from_tensors(family, family.spec_from_hf(hf.to_dict()), tensors, family.hf_tensors, config)
    path = write_checkpoint(model_type, directory, "tiny", seed=0)
    return load_model(path, config, progress=False).model


@pytest.fixture(scope="module", params=FAMILIES, ids=FAMILIES)
def model(request, tmp_path_factory):
    _runnable(request.param)
    return build_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture
def small_blocks(monkeypatch) -> int:
    monkeypatch.setattr(cache_module, "BLOCK_TOKENS", SMALL_BLOCK_TOKENS)
    return SMALL_BLOCK_TOKENS
