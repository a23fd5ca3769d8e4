"""Small working tokenizers for test checkpoints: a byte-level BPE trained on a built-in
text, with each family's special tokens at fixed ids and its chat template.

Ids: `head` specials take 0..len(head)-1 (DeepSeek keeps BOS/EOS/PAD there), the BPE
vocabulary follows, `<|reserved_token_i|>` fills any gap, and the `tail` specials take the
last ids (most families; e.g. Kimi's `[PAD]` is the last id, as in the real vocabulary).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 640  # tokenizer size of every test family; config vocab_size may pad beyond it


@dataclass(frozen=True, slots=True)
class TokenizerLayout:
    """A family's special tokens, their roles and its chat template."""

    tail: tuple[str, ...]
    chat_template: str
    head: tuple[str, ...] = ()
    bos: str | None = None
    eos: str | None = None
    pad: str | None = None
    unk: str | None = None
    stop: tuple[str, ...] = ()  # extra end-of-generation tokens for generation_config.json
    not_special: frozenset[str] = field(default_factory=frozenset)  # added tokens matched whole but kept in decode
    add_bos_token: bool = False
    template_file: bool = False  # chat_template.jinja instead of tokenizer_config.json["chat_template"]
    vocab_size: int = VOCAB_SIZE

    def id(self, token: str | None) -> int | None:
        """The id `token` has in the written tokenizer (None for None)."""
        if token is None:
            return None
        if token in self.head:
            return self.head.index(token)
        return self.vocab_size - len(self.tail) + self.tail.index(token)


CORPUS = """\
Mixture-of-experts language models route every token to a few experts out of many. The router
scores each expert, keeps the best ones, and mixes their outputs with the normalised scores. Most
of the weights sit in the experts, so a runtime that pages experts between disk, host memory and
the graphics card can run a model far larger than its memory, as long as the experts it needs next
are already close at hand. Tokens that follow each other tend to reuse experts; a cache that keeps
recently and frequently used experts resident turns most reads into hits.

The quick brown fox jumps over the lazy dog. A small test model has random weights, so what it
writes is noise, but its shapes, names and numbers of layers match the real thing, and a loader
that reads it correctly will read the real checkpoint too. Every tensor has a name, a data type
and a shape; the header of a safetensors file lists them all, followed by the raw bytes.

Attention layers compare a query with the keys of earlier tokens. Linear attention keeps a fixed
state instead of a growing cache: the state decays, and each new key and value is written into it
with a delta rule. Latent attention compresses keys and values into a small latent vector per
token, which keeps the cache small at long context. Sparse attention selects the top scoring keys
with a light indexer and attends only to those.

User: What is the capital of France?
Assistant: The capital of France is Paris.
User: Write a function that adds two numbers.
Assistant: def add(a, b):
    return a + b

print(add(2, 3))  # 5
for i in range(10):
    if i % 2 == 0:
        print(i, "is even")
    else:
        print(i, "is odd")

{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}
The weather in Berlin is 21 degrees and sunny. Tomorrow it will rain in the morning and clear up in
the afternoon. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 42 7168 163840.

Once upon a time there was a little model that wanted to think. It thought about the question,
wrote down its reasoning step by step, and then gave a short answer. When it did not know the
answer, it said so. When it was asked to call a tool, it named the tool and gave the arguments,
then waited for the result before it answered the user. It was a good and helpful assistant.

Questions and answers, tools and results, thinking and responding: the chat format wraps each
message in special tokens so the model knows who is speaking and when a turn ends. The end of a
message is a stop token; generation ends there. The beginning of a sequence may carry its own
token, and padding fills batches to the same length.
"""


@functools.cache
def tokenizer_json(layout: TokenizerLayout) -> str:
    """The `tokenizer.json` text for `layout` (deterministic: same layout, same bytes)."""
    n_bpe = layout.vocab_size - len(layout.tail)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[AddedToken(t, special=True, normalized=False) for t in layout.head])
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    gap = n_bpe - tok.get_vocab_size()
    if gap < 0:
        raise AssertionError(f"BPE trained {tok.get_vocab_size()} tokens, more than the {n_bpe} asked for")
    tok.add_special_tokens([AddedToken(f"<|reserved_token_{i}|>", special=True, normalized=False) for i in range(gap)])
    for t in layout.tail:  # one at a time: ids follow the order of `tail`
        if t in layout.not_special:
            tok.add_tokens([AddedToken(t, special=False, normalized=False)])
        else:
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
    if tok.get_vocab_size() != layout.vocab_size:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {layout.vocab_size}")
    for t in (*layout.head, *layout.tail):
        assert tok.token_to_id(t) == layout.id(t), t
    if layout.add_bos_token and layout.bos:
        bos = (layout.bos, layout.id(layout.bos))
        tok.post_processor = processors.TemplateProcessing(single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B",
                                                           special_tokens=[bos])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str(pretty=True)


def write_tokenizer(directory: Path, layout: TokenizerLayout, model_max_length: int) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json (and
    chat_template.jinja) into `directory`; returns the paths written."""
    (directory / "tokenizer.json").write_text(tokenizer_json(layout), encoding="utf-8")
    roles = {"bos_token": layout.bos, "eos_token": layout.eos, "pad_token": layout.pad, "unk_token": layout.unk}
    roles = {k: v for k, v in roles.items() if v is not None}
    added = {str(layout.id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                 "single_word": False, "special": t not in layout.not_special}
             for t in (*layout.head, *layout.tail)}
    config = {"added_tokens_decoder": added, "add_bos_token": layout.add_bos_token, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": model_max_length,
              "tokenizer_class": "PreTrainedTokenizerFast", **roles}
    written = [directory / "tokenizer.json", directory / "tokenizer_config.json", directory / "special_tokens_map.json"]
    if layout.template_file:
        (directory / "chat_template.jinja").write_text(layout.chat_template, encoding="utf-8")
        written.append(directory / "chat_template.jinja")
    else:
        config["chat_template"] = layout.chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                     encoding="utf-8")
    (directory / "special_tokens_map.json").write_text(json.dumps(roles, indent=2, ensure_ascii=False) + "\n",
                                                       encoding="utf-8")
    return written


def generation_config(layout: TokenizerLayout) -> dict:
    """generation_config.json: BOS, PAD and every end-of-generation id."""
    stops = [layout.id(t) for t in (layout.eos, *layout.stop) if t is not None]
    out: dict = {"bos_token_id": layout.id(layout.bos), "eos_token_id": stops[0] if len(stops) == 1 else stops,
                 "pad_token_id": layout.id(layout.pad)}
    return {k: v for k, v in out.items() if v is not None}
