"""The tokenizer the engine uses: a `tokenizers.Tokenizer` plus the facts generation needs.

Built by `tokenizer_from_gguf` (from `tokenizer.ggml.*` metadata) or `tokenizer_from_hf_dir`
(from `tokenizer.json`); both hand over a finished backend, so this class holds no format
logic. Special tokens written in the text (`<|im_start|>`) are always matched whole, which
is what rendered chat templates need.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import processors

from localmoe.chat.template import render_chat_template
from localmoe.errors import TokenizerError

# Token texts that end a turn, found by text the way llama.cpp's llama-vocab.cpp finds its
# end-of-generation set (its FIM tokens, which it also stops on, are left out).
END_OF_TURN_TOKENS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<|end_of_msg|>",
)


def end_of_generation_ids(token_to_id: Callable[[str], int | None]) -> set[int]:
    """Ids of the end-of-turn tokens a vocabulary has (`token_to_id` gives None for absent ones)."""
    found = {text: token_to_id(text) for text in END_OF_TURN_TOKENS}
    found = {text: i for text, i in found.items() if i is not None}
    # gpt-oss (o200k_harmony) and solar-open end a message with <|end|> but keep generating.
    if {"<|return|>", "<|call|>"} <= found.keys() or {"<|calls|>", "<|flush|>"} <= found.keys():
        found.pop("<|end|>", None)
    # gemma4 ends turns with <|tool_response>; its </s> is an ordinary token.
    if "<|tool_response>" in found:
        found.pop("</s>", None)
    return set(found.values())


def bos_eos_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """A post-processor adding `bos` before and `eos` after each sequence; each is (text, id) or None."""
    first = [f"{bos[0]}:0"] if bos else []
    last = [f"{eos[0]}:0"] if eos else []
    return processors.TemplateProcessing(single=" ".join([*first, "$A:0", *last]),
                                         pair=" ".join([*first, "$A:0", *last, *first, "$B:1", *last]),
                                         special_tokens=list(dict(t for t in (bos, eos) if t).items()))


class Tokenizer:
    """Text <-> token ids, special-token facts, chat template and streaming decode."""

    def __init__(self, backend: tokenizers.Tokenizer, *, source: str, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, pad_token_id: int | None = None,
                 unk_token_id: int | None = None, extra_stop_ids: Iterable[int] = (),
                 chat_template: str | None = None):
        self.backend = backend
        self.source = source
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        stops = end_of_generation_ids(backend.token_to_id) | set(extra_stop_ids)
        if eos_token_id is not None:
            stops.add(eos_token_id)
        self.stop_token_ids: frozenset[int] = frozenset(stops)
        self._bos_text = self.id_to_token(bos_token_id) if bos_token_id is not None else None
        # Whether encode(add_special_tokens=True) prepends BOS (decided by the backend's post-processor).
        self.add_bos_token = (bos_token_id is not None
                              and backend.encode("", add_special_tokens=True).ids[:1] == [bos_token_id])

    def __repr__(self) -> str:
        return (f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token_id}, eos={self.eos_token_id})")

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens as text: {"bos_token": ..., "eos_token": ..., "pad_token": ..., "unk_token": ...}."""
        named = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id,
                 "pad_token": self.pad_token_id, "unk_token": self.unk_token_id}
        texts = {name: self.id_to_token(i) for name, i in named.items() if i is not None}
        return {name: text for name, text in texts.items() if text is not None}

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it become their ids.

        With `add_special_tokens` the model's BOS/EOS are added as its tokenizer asks, but a text
        that already starts with BOS (a rendered chat template) gets no second one, as llama.cpp does.
        """
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos_token and len(ids) >= 2 and ids[1] == self.bos_token_id
                and self._bos_text and text.startswith(self._bos_text)):
            ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (e.g. a cut multi-byte character) shows as U+FFFD."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt text for `messages`, rendered with this model's chat template."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.source} has no chat template; pass a template file or use plain completion")
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, special_tokens=self.special_tokens,
                                    source=f"chat template of {self.source}", **extra)


class StreamDecoder:
    """Incremental detokenizer: `feed(id)` returns the text that became complete, `flush()` the rest.

    The concatenation of everything returned equals `decode(all ids)`. A multi-byte character
    split over several tokens is held back until its last byte arrives, so valid text never
    shows U+FFFD mid-stream; the text before it (a token that completes one character and starts
    the next) goes out at once. Each step decodes only the tokens since the last emitted text plus
    one window of earlier ones (the prefix/read offsets of HF TGI and vLLM), so decoders that
    treat the first token specially (SentencePiece's leading-space strip) stay correct.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded each step
        self._read = 0    # end of the tokens whose text has been emitted
        self._sent = 0    # characters emitted past the text of tokens [prefix, read): whole ones before a partial one

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def feed(self, token_id: int) -> str:
        self._ids.append(token_id)
        done = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        start = len(done) + self._sent
        if text.endswith("\ufffd"):  # a character still incomplete: only the whole ones before it
            piece = text.rstrip("\ufffd")[start:]
            self._sent += len(piece)
            return piece
        if len(text) <= start:
            return ""
        self._prefix, self._read, self._sent = self._read, len(self._ids), 0
        return text[start:]

    def __call__(self, token_ids: Iterable[int]) -> Iterator[str]:
        """Feed each id, yielding non-empty pieces, then the flushed rest."""
        for token_id in token_ids:
            if piece := self.feed(token_id):
                yield piece
        if rest := self.flush():
            yield rest

    def flush(self) -> str:
        """The text still held back; an incomplete character at the end comes out as U+FFFD."""
        done = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        start = len(done) + self._sent
        self._prefix, self._read, self._sent = self._read, len(self._ids), 0
        return text[start:]
