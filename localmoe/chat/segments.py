"""Token plumbing shared by the formats built from special tokens (XTML, harmony).

Prompts are assembled from pieces: structural special tokens go in as ids, and each text
piece is encoded on its own by a copy of the tokenizer that never matches special tokens,
so text a user wrote ("<|open|>") stays text. Generated ids are read back as events: a
structural id, or the text of the run of ordinary ids between two of them. `parse_ids`
decodes each run whole; `EventStream` decodes one id at a time (UTF-8 safe) and hands the
same events to the same reader, so parsing and streaming can only differ in decoding.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import tokenizers

from localmoe.chat.format import Delta, ParsedReply
from localmoe.errors import TokenizerError


class Pieces:
    """Encodes prompt pieces for one tokenizer: special tokens by name, text never as special tokens."""

    def __init__(self, tokenizer, special_tokens: Iterable[str], family: str):
        self.tokenizer = tokenizer
        self.ids: dict[str, int] = {}
        for text in special_tokens:
            token_id = tokenizer.token_to_id(text)
            if token_id is None:
                raise TokenizerError(f"{tokenizer.source}: the {family} chat format needs the special token "
                                     f"{text!r}, which this tokenizer does not have")
            self.ids[text] = token_id
        # A private copy: flipping encode_special_tokens on the shared backend would race other encodes.
        self._text_backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
        self._text_backend.encode_special_tokens = True

    def text(self, text: str) -> list[int]:
        """Ids of `text` as plain text: special-token strings in it are not matched."""
        if not text:
            return []
        return self._text_backend.encode(text, add_special_tokens=False).ids

    def build(self, pieces: Iterable[str | int]) -> list[int]:
        """Ids of `pieces`: an int is a token id, a str is text."""
        out: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                out.append(piece)
            else:
                out.extend(self.text(piece))
        return out


class Reader(Protocol):
    """A format's interpreter of events; each call returns the deltas it completes."""

    reply: ParsedReply

    def special(self, token_id: int) -> list[Delta]: ...

    def text(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...


def parse_ids(tokenizer, structural: set[int], reader: Reader, token_ids: Sequence[int]) -> ParsedReply:
    """Feed `token_ids` to `reader` as events, decoding each text run whole."""
    run: list[int] = []
    for token_id in token_ids:
        if token_id in structural:
            if run:
                reader.text(tokenizer.decode(run))
                run = []
            reader.special(token_id)
        else:
            run.append(token_id)
    if run:
        reader.text(tokenizer.decode(run))
    reader.finish()
    return reader.reply


class EventStream:
    """A StreamParser: one id at a time into `reader`, text through a UTF-8-safe stream decoder."""

    def __init__(self, tokenizer, structural: set[int], reader: Reader):
        self._tokenizer = tokenizer
        self._structural = structural
        self._reader = reader
        self._decoder = tokenizer.stream_decoder()
        self._flushed = False

    def feed(self, token_id: int) -> list[Delta]:
        """Consume one generated token; return the deltas it completes."""
        if self._flushed:
            return []
        if token_id in self._structural:
            deltas = self._text(self._decoder.flush())
            self._decoder = self._tokenizer.stream_decoder()
            return deltas + self._reader.special(token_id)
        return self._text(self._decoder.feed(token_id))

    def _text(self, piece: str) -> list[Delta]:
        return self._reader.text(piece) if piece else []

    def flush(self) -> list[Delta]:
        """End of generation: the deltas still held back."""
        if self._flushed:
            return []
        self._flushed = True
        return self._text(self._decoder.flush()) + self._reader.finish()

    def finish(self) -> ParsedReply:
        """End of generation: flush and return the whole reply."""
        self.flush()
        return self._reader.reply
