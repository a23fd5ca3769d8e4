"""The real SmolLM2-135M-Instruct GGUF against transformers loading the same file.

transformers dequantises the GGUF into its own LlamaForCausalLM (an implementation that
shares no code with ours); both run in fp32.
"""

import pytest
import torch

from localmoe.engine.generate import prefill
from localmoe.engine.sampler import SamplingParams, sample
from localmoe.load import load_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Translate to German: The weather is nice today, and we are going to the lake.",
]


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return load_model(smollm2_gguf, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                              dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("prompt", PROMPTS, ids=["france", "code", "translate"])
def test_last_position_logits_match(ours, reference, prompt):
    ids = ours.tokenizer.encode(prompt)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1]
    got = prefill(ours.model, ids, ours.model.new_cache(1, 256))[0]
    logit_range = (expected.max() - expected.min()).item()
    assert (got - expected).abs().max().item() <= 1e-3 * logit_range
    assert got.argmax() == expected.argmax()


def test_32_greedy_tokens_identical(ours, reference):
    ids = ours.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    cache = ours.model.new_cache(1, 256)
    logits = prefill(ours.model, ids, cache)
    got = []
    for _ in range(32):
        token = sample(logits, SamplingParams(temperature=0))
        got.append(int(token))
        logits = ours.model.forward(token.view(1, 1), cache)[:, -1]
    assert got == expected
    assert "Paris" in ours.tokenizer.decode(got)


def test_answer_through_the_public_api(ours):
    from localmoe.runtime.local import LocalModel

    chunks = list(LocalModel(ours).stream("What is the capital of France?", SamplingParams(temperature=0),
                                          max_tokens=32))
    result = chunks[-1].result
    assert "Paris" in result.content and "".join(c.text for c in chunks) == result.content
    assert result.finish_reason == "stop"  # the model ends its turn with <|im_end|>, which is not shown
    assert "<|im_end|>" not in result.content


def test_dense_gguf_store_runs(smollm2_gguf, tmp_path):
    """A dense GGUF converted to a store (raw blocks kept, typed by gguf-tensors.json) runs like the file."""
    from localmoe.convert import convert

    convert(smollm2_gguf, tmp_path / "store", progress=False)
    from localmoe.runtime.local import LocalModel

    store, file = (LocalModel(load_model(p, progress=False)) for p in (tmp_path / "store", smollm2_gguf))
    greedy = SamplingParams(temperature=0)
    question = "What is the capital of France?"
    assert store.generate(question, greedy, 16).content == file.generate(question, greedy, 16).content
    assert store.model.weight_bytes() == file.model.weight_bytes()  # blocks kept, not dequantised
