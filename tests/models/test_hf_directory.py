"""An HF safetensors directory (config.json + model.safetensors + tokenizer.json) loads end to end
and matches transformers loading the same directory."""

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from localmoe.load import load_model

transformers = pytest.importorskip("transformers")

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _write_tokenizer(path, vocab_size):
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [" ", ".", "?", "\n"]
    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, **{ch: i + 3 for i, ch in enumerate(letters)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<unk>", "<|im_start|>", "<|im_end|>"])
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "unk_token": "<unk>", "chat_template": TEMPLATE}))
    assert len(vocab) <= vocab_size


@pytest.fixture(scope="module", params=["single", "sharded"])
def directory(tmp_path_factory, request):
    path = tmp_path_factory.mktemp(request.param)
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)  # checkpoints ship bf16
    model.save_pretrained(path, max_shard_size="20KB" if request.param == "sharded" else "1GB")
    _write_tokenizer(path, config.vocab_size)
    if request.param == "sharded":
        assert (path / "model.safetensors.index.json").exists()
    return path, model.float().eval()


def test_logits_match_transformers(directory):
    path, reference = directory
    ours = load_model(path, dtype="float32", progress=False)
    ids = ours.tokenizer.encode("hello world. how are you?")
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits
    got = ours.model.forward(torch.tensor([ids]), ours.model.new_cache(1, 64), all_logits=True)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_chat_prompt_uses_the_directory_template(directory):
    path, _ = directory
    ours = load_model(path, dtype="float32", progress=False)
    ids = ours.chat_prompt([{"role": "user", "content": "hi"}])
    assert ours.tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ours.tokenizer.token_to_id("<|im_end|>") in ours.tokenizer.stop_token_ids
