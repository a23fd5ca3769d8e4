"""Drafters behind one interface: `propose(history, k, params, generator) -> Draft`.

- `PromptLookup`: no model. The sequence's last tokens are looked up among the earlier ones (prompt and
  generated text): of the earlier occurrences of its last `min_ngram` tokens, the one preceded by the
  longest match (the most recent of equals) gives the draft, the tokens that followed it. The match length
  goes with the draft (`Draft.match`): a long match is a quote in progress and its drafts are mostly kept,
  a single-token match mostly not (SmolLM2 answering a document question: most drafts after 1-token
  matches rejected, nearly all kept after 6+), so the speculator prices them apart. With the tokenizer, matching ignores whitespace (a model
  quoting a hard-wrapped document joins its lines). Agents' work (code edits, document Q&A, tool results
  quoted back) repeats long spans of the prompt, which this drafts for free. Deterministic: q is one-hot.
- `DraftModel` (draft_model.py): a smaller model sharing the target's tokenizer, run token by token over its
  own cache.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from localmoe.engine.sampler import SamplingParams


@dataclass(slots=True)
class Draft:
    tokens: list[int]
    q: torch.Tensor | None = None  # [k, V]: the distribution each draft was drawn from; None = deterministic
    source: int | None = None  # copied from the sequence: the position the first draft stood at (residency.py)
    match: int = 0  # copied: how many tokens before it matched the sequence's last ones (its confidence)

    def first(self, n: int) -> Draft:
        """The draft's first n tokens."""
        if n >= len(self.tokens):
            return self
        return Draft(self.tokens[:n], None if self.q is None else self.q[:n], self.source, self.match)


NO_DRAFT = Draft([])  # what a drafter without a draft returns (never changed: `Draft.first` of it is itself)


class Drafter(Protocol):
    name: str
    # optional: `free` (declining to draft costs nothing but the lookup, so the speculator never retires it) and
    # `matches` (its drafts carry their match length, `Draft.match`: the speculator prices them by class, and
    # `propose` takes `least`, the shortest match worth a draft: none is built after a shorter one), `deterministic`
    # (with `matches` and `shadow(i, k)`, the fate of the draft it had at key i: a class that does not pay is tried in
    # the shadow after the fact, speculator.py `_review`, not by a verify), `quiet(length, least)` (the next steps
    # that certainly find no match of `least`: the speculator rests, `Speculator.rest`), `hopeless(length, least)` (with `matches`: True where a history
    # of that length can hold no match of `least` tokens; the speculator then skips the call)

    def propose(self, history: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator) -> Draft:
        """Up to k tokens likely to follow `history` (the sequence so far, its last token not yet run)."""


class PromptLookup:
    """Lookup over the sequence itself (see the module docstring). The keys (a token each) go into a suffix
    automaton as they come (amortised O(1) a token): after each, the automaton knows the longest suffix of the
    sequence that occurred before and a recent place where it ended (where a longer match's last occurrence is
    later than the short suffix's, the short one's place may be an older occurrence). A step whose match is shorter
    than the speculator's `least` costs a comparison; one that drafts, the draft's tokens. With the model's
    `tokenizer` the match ignores whitespace (near-quotes: a model quoting a document joins its hard-wrapped
    lines, re-indents code): tokens are compared by their text without whitespace, whitespace-only tokens are
    skipped, and where the quote so far spaced the matched words differently from the source, the source's
    continuation is respaced the same way and tokenized afresh. Memory: ~2 automaton states a key."""

    name = "prompt"
    free = matches = deterministic = True

    def __init__(self, min_ngram: int = 1, tokenizer=None):
        if min_ngram < 1:
            raise ValueError(f"prompt lookup needs min_ngram >= 1, not {min_ngram}")
        self.min_ngram, self.tokenizer = min_ngram, tokenizer
        # token id -> its text, and its text less whitespace (its key), with a tokenizer: shared by every sequence of
        # that tokenizer (a decode call per new token id cost ~10 us in the decode loop, each request anew)
        self._text, self._stripped = _texts(tokenizer)
        self._reset()

    def _reset(self) -> None:
        self._n, self._last_token = 0, None  # the length of the history indexed so far, its last token
        self._keys: list = []  # what is compared: ids, or (with a tokenizer) their text less whitespace
        self._at: list[int] = []  # each key's position in the history (whitespace-only tokens have none)
        # the suffix automaton of the keys: per state its transitions (key -> state), suffix link, longest string's
        # length, and a key index where its strings end (the latest seen where it last was the longest match)
        self._next: list[dict] = [{}]
        self._link, self._len, self._end = [-1], [0], [-1]
        self._last = 0  # the state of the whole sequence
        self._found = (-1, 0)  # (the key index where the last key's longest earlier match ends, its length)
        # per key: where its longest earlier match ended (-1: none) and its length (`shadow`: a draft's fate after
        # the fact)
        self._src: list[int] = []
        self._mlen: list[int] = []
        self.indexed = 0  # calls that fed the index (tests count them: a declining step's lookup work)

    def _key(self, token: int):
        if self.tokenizer is None:
            return token
        key = self._stripped.get(token)
        if key is None:
            text = self._text[token] = self.tokenizer.decode([token])
            key = self._stripped[token] = _SPACE.sub("", text)
        return key

    def _update(self, history: Sequence[int]) -> None:
        history = history if isinstance(history, list) else list(history)
        n_seen = self._n
        # the same sequence grows at its end; a rewind (an injected token drops kept drafts) drops only tokens the
        # index never saw (they came after its last call), so the last token seen tells; any other history: afresh
        if len(history) < n_seen or n_seen and history[n_seen - 1] != self._last_token:
            self._reset()
            n_seen = 0
        if n_seen < len(history):
            self.indexed += 1
        for at in range(n_seen, len(history)):
            key = self._key(history[at])
            if key != "":
                self._extend(key, at)
        self._n = len(history)
        self._last_token = history[-1] if history else None

    def _extend(self, key, at: int) -> None:
        """Append a key to the automaton (the online construction; a clone where a state splits), and note the
        longest earlier match of the sequence's suffix (the new state's suffix link) and where it ended."""
        nxt, link, length, end = self._next, self._link, self._len, self._end
        i = len(self._keys)
        self._keys.append(key)
        self._at.append(at)
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self._last] + 1)
        end.append(i)
        p = self._last
        while p != -1 and key not in nxt[p]:
            nxt[p][key] = cur
            p = link[p]
        self._last = cur
        if p == -1:  # a key never seen before: no match
            self._found = (-1, 0)
            self._src.append(-1)
            self._mlen.append(0)
            return
        q = nxt[p][key]
        if length[p] + 1 == length[q]:
            s = q
        else:  # q's strings split: the shorter ones (suffixes of the sequence now) go to a clone
            s = len(length)
            nxt.append(dict(nxt[q]))
            link.append(link[q])
            length.append(length[p] + 1)
            end.append(end[q])
            while p != -1 and nxt[p].get(key) == q:
                nxt[p][key] = s
                p = link[p]
            link[q] = s
        link[cur] = s
        self._found = (end[s], length[s])  # an earlier place of the longest repeated suffix (end[s] < i)
        self._src.append(end[s])
        self._mlen.append(length[s])
        end[s] = i

    def hopeless(self, length: int, least: int) -> bool:
        """Whether a history of `length` tokens, the one indexed grown at its end, can have no match of `least` keys:
        a match grows by a key a token at most, so until one is possible the new tokens wait, and the index takes them
        when it is (a few tokens in one call: each call after the model's forward runs with cold caches)."""
        grown = length - self._n
        return 0 < grown and self._found[1] + grown < least

    def quiet(self, length: int, least: int) -> int:
        """How many of the next steps (a token each) certainly find no match of `least` keys, the history now
        `length` tokens: a match grows by a key a token at most (`hopeless`), so those steps need no lookup."""
        return max(0, least - self._found[1] - (length - self._n) - 1)

    def shadow(self, i: int, k: int) -> tuple[int, int] | None:
        """After the fact: the draft of up to k keys the lookup had at key i (the keys after its match, which
        ended before i) against the keys that followed i -> (kept until the first difference, the draft's
        length), or None while the keys that decide it have not come yet. Keys, not tokens: whitespace is
        compared as the respaced draft would be (`_respaced`)."""
        c, keys = self._src[i], self._keys
        n = min(k, i - c)
        for j in range(n):
            if i + 1 + j >= len(keys):
                return None
            if keys[c + 1 + j] != keys[i + 1 + j]:
                return j, n
        return n, n

    def propose(self, history: Sequence[int], k: int, params: SamplingParams = None,
                generator: torch.Generator | None = None, least: int = 1) -> Draft:
        """Up to k tokens after the longest match; none where it is shorter than `least` tokens."""
        if k <= 0 or len(history) < 2 or self.hopeless(len(history), least):
            return NO_DRAFT
        self._update(history)
        c, length = self._found
        if c < 0 or length < least or length < self.min_ngram:
            return NO_DRAFT
        length = min(length, LONGEST)
        source = self._at[c] + 1
        if self.tokenizer is None:
            return Draft(list(history[source:source + k]), source=source, match=length)
        return self._respaced(history, c, length, k)

    def _gap(self, history: Sequence[int], key: int) -> str:
        """The whitespace between key `key - 1` and key `key` (the end of one token, whitespace-only tokens,
        the start of the next)."""
        before = self._text[history[self._at[key - 1]]] if key > 0 else ""
        between = "".join(self._text[t] for t in history[self._at[key - 1] + 1:self._at[key]]) if key > 0 else ""
        here = self._text[history[self._at[key]]]
        return before[len(before.rstrip()):] + between + here[:len(here) - len(here.lstrip())]

    def _respaced(self, history: Sequence[int], c: int, length: int, k: int) -> Draft:
        """The draft after the match ending at key `c`: the source's tokens where the match spaced its words as
        the source did, else the source's text respaced as the quote spaces it, tokenized afresh."""
        last = len(self._keys) - 1
        spacing = {}  # the source's gaps -> the quote's, over the match
        for i in range(length - 1):
            spacing[self._gap(history, c - i)] = self._gap(history, last - i)
        source = self._at[c] + 1
        tail = list(history[self._at[last] + 1:])  # whitespace-only tokens the quote has after its last key
        if all(a == b for a, b in spacing.items()) and list(history[source:source + len(tail)]) == tail:
            return Draft(list(history[source + len(tail):source + len(tail) + k]), source=source + len(tail),
                         match=length)
        parts = [spacing.get(gap, gap) + self._text[history[self._at[key]]].strip()
                 for key in range(c + 1, min(c + k + 2, last + 1)) for gap in (self._gap(history, key),)]
        text, done = "".join(parts), "".join(self._text[t] for t in tail)
        if not text.startswith(done):
            return NO_DRAFT
        return Draft(self.tokenizer.encode(text[len(done):], add_special_tokens=False)[:k], source=source,
                     match=length)


_SPACE = re.compile(r"\s+")
_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (id -> text, id -> key)


def _texts(tokenizer) -> tuple[dict[int, str], dict[int, str]]:
    if tokenizer is None:
        return {}, {}
    try:
        return _TEXTS.setdefault(tokenizer, ({}, {}))
    except TypeError:  # not weakly referenceable: the sequence's own
        return {}, {}
LONGEST = 32  # a match's length is counted this far at most (its class, and the respacing it compares)
