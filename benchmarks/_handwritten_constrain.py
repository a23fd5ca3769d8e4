"""Constrained decoding of tool-call arguments: the output stays a prefix of a JSON object
that matches the tool's schema (declared keys, required keys, value types, enums).

The validator works on characters and is purely functional: a state is an immutable tuple
of frames, `step(state, ch)` returns the next state or None (rejected), so trying a
candidate token costs nothing to undo. The token chooser ranks the vocabulary by logit and
takes the best token whose text keeps the output valid (greedy), or samples among the
valid ones of the top ranks. Lengths are capped (strings, numbers, arrays, whitespace) so
that a constrained generation always terminates.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

MAX_STRING = 48  # characters in a string without maxLength (keeps a forced call within a few dozen tokens)
MAX_DIGITS = 16
MAX_ITEMS = 16  # array items without maxItems
MAX_FREE_KEYS = 16  # keys of an object that declares no properties
MAX_WS_RUN = 2  # consecutive whitespace characters
MAX_WS_TOTAL = 32  # whitespace characters in the whole output
MAX_DEPTH = 8
WHITESPACE = " \t\n\r"  # what JSON allows between tokens
WRITTEN_WHITESPACE = " \n"  # what constrained output may use
KEY_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")

State = tuple  # (frames, whitespace run, whitespace total); frames is a tuple, top last; () = complete


def _types(schema: dict) -> set[str]:
    declared = schema.get("type")
    if declared is None:
        if "properties" in schema:
            return {"object"}
        if "items" in schema:
            return {"array"}
        return {"object", "array", "string", "number", "integer", "boolean", "null"}
    names = {declared} if isinstance(declared, str) else set(declared)
    if "number" in names:
        names.add("integer")
    return names


def _keys(schema: dict) -> tuple[str, ...] | None:
    """Declared property names, or None when the object takes free keys."""
    properties = schema.get("properties")
    return tuple(properties) if isinstance(properties, dict) and properties else None


def initial_state(schema: dict, prefix: str | Sequence[str | tuple[str, ...]] = "",
                  schemas: dict[str, dict] | None = None) -> State:
    """The state before any output: `prefix`, then one JSON object of `schema`.

    `prefix` is a literal string or a list of segments: literal strings and tuples of
    options (exactly one option is written). With `schemas` ({option: schema}), the option
    chosen for the tuple segment decides the object's schema instead of `schema`.
    """
    segments = [prefix] if isinstance(prefix, str) else list(prefix)
    bound = None
    if schemas:
        bound = tuple(sorted((name, _Schema(_as_object(s))) for name, s in schemas.items()))
    frames: tuple = (("value", None if bound else _Schema(_as_object(schema)), 0),)
    for segment in reversed(segments):
        if isinstance(segment, str):
            if segment:
                frames = frames + (("lit", segment),)
        else:
            frames = frames + (("choice", tuple(segment), "", bound),)
    return (frames, 0, 0)


def _as_object(schema: dict | None) -> dict:
    root = dict(schema or {})
    root["type"] = "object"
    return root


def _bind(frames: tuple, bound, option: str) -> tuple:
    """Give the waiting value frame the schema of the chosen option."""
    if not bound:
        return frames
    schema = dict(bound)[option]
    return tuple(("value", schema, f[2]) if f[0] == "value" and f[1] is None else f for f in frames)


class _Schema:
    """A schema wrapped so frames hash and compare cheaply (by identity)."""

    __slots__ = ("_children", "enum", "keys", "required", "schema", "types")

    def __init__(self, schema: Any):
        schema = schema if isinstance(schema, dict) else {}
        self.schema = schema
        self.types = _types(schema)
        self.keys = _keys(schema)
        required = schema.get("required") or []
        self.required = frozenset(k for k in required if isinstance(k, str) and (self.keys is None or k in self.keys))
        enum = schema.get("enum")
        self.enum = tuple(json.dumps(v) for v in enum) if isinstance(enum, list) and enum else None
        self._children: dict = {}

    def child(self, key: str | None) -> _Schema:
        """Schema of property `key` (None: array items)."""
        if key not in self._children:
            if key is None:
                sub = self.schema.get("items", {})
            else:
                sub = (self.schema.get("properties") or {}).get(key, self.schema.get("additionalProperties", {}))
            self._children[key] = _Schema(sub if isinstance(sub, dict) else {})
        return self._children[key]

    def int_option(self, name: str, default: int) -> int:
        value = self.schema.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def _start_value(frames: tuple, schema: _Schema, depth: int, ch: str) -> tuple | None:
    """Frames after the first character `ch` of a value of `schema` (its frame replaced), or None."""
    if schema.enum is not None:
        if any(option.startswith(ch) for option in schema.enum):
            return frames + (("choice", schema.enum, ch, None),)
        return None
    types = schema.types
    if ch == "{" and "object" in types and depth < MAX_DEPTH:
        return frames + (("obj", schema, frozenset(), "start", depth),)
    if ch == "[" and "array" in types and depth < MAX_DEPTH:
        return frames + (("arr", schema, 0, "start", depth),)
    if ch == '"' and "string" in types:
        return frames + (("str", schema.int_option("maxLength", MAX_STRING), schema.int_option("minLength", 0), 0, 0),)
    if (ch == "-" or ch.isdigit()) and ch.isascii() and ({"number", "integer"} & types):
        integer = "number" not in types
        return frames + (("num", integer, "zero" if ch == "0" else ("sign" if ch == "-" else "int"), 1),)
    for word, kind in (("true", "boolean"), ("false", "boolean"), ("null", "null")):
        if ch == word[0] and kind in types:
            return frames + (("lit", word[1:]),) if len(word) > 1 else frames
    return None


_NUM_NEXT = {  # number states: (character class -> next state); classes: d=digit, .=point, e=exponent, s=sign
    "sign": {"0": "zero", "d": "int"},
    "zero": {".": "frac0", "e": "exp0"},
    "int": {"d": "int", "0": "int", ".": "frac0", "e": "exp0"},
    "frac0": {"d": "frac", "0": "frac"},
    "frac": {"d": "frac", "0": "frac", "e": "exp0"},
    "exp0": {"s": "expsign", "d": "exp", "0": "exp"},
    "expsign": {"d": "exp", "0": "exp"},
    "exp": {"d": "exp", "0": "exp"},
}
_NUM_COMPLETE = {"zero", "int", "frac", "exp"}


def _number_class(ch: str) -> str | None:
    if ch == "0":
        return "0"
    if ch in "123456789":
        return "d"
    return {".": ".", "e": "e", "E": "e", "+": "s", "-": "s"}.get(ch)


def _step_frames(frames: tuple, ch: str) -> tuple | None:
    """Frames after `ch`, or None when `ch` cannot follow."""
    if not frames:
        return None  # the object is complete: nothing may follow
    top = frames[-1]
    rest = frames[:-1]
    kind = top[0]
    if kind == "lit":
        text = top[1]
        if ch != text[0]:
            return None
        return rest + (("lit", text[1:]),) if len(text) > 1 else rest
    if kind == "value":
        if ch in WHITESPACE:
            return frames
        return _start_value(rest, top[1], top[2], ch)
    if kind == "str":
        _, limit, minimum, length, escape = top
        if escape == 1:
            if ch == "u":
                return rest + (("str", limit, minimum, length, 2),)
            if ch in '"\\/bfnrt':
                return rest + (("str", limit, minimum, length + 1, 0),)
            return None
        if escape >= 2:
            if ch not in "0123456789abcdefABCDEF":
                return None
            return rest + (("str", limit, minimum, length + (escape == 5), 0 if escape == 5 else escape + 1),)
        if ch == '"':
            return rest if length >= minimum else None
        if length >= limit or ord(ch) < 0x20:
            return None
        if ch == "\\":
            return rest + (("str", limit, minimum, length, 1),)
        return rest + (("str", limit, minimum, length + 1, 0),)
    if kind == "num":
        _, integer, state, digits = top
        cls = _number_class(ch)
        nxt = _NUM_NEXT[state].get(cls) if cls else None
        if nxt is not None and integer and cls in ".e":
            nxt = None
        if nxt is not None and (cls not in "0d" or digits < MAX_DIGITS):
            return rest + (("num", integer, nxt, digits + (cls in "0d")),)
        if state in _NUM_COMPLETE:
            return _step_frames(rest, ch)  # the number ended; `ch` belongs to the enclosing value
        return None
    if kind == "choice":
        _, options, consumed, bound = top
        extended = consumed + ch
        if any(option.startswith(extended) for option in options):
            return rest + (("choice", options, extended, bound),)
        if consumed in options:
            return _step_frames(_bind(rest, bound, consumed), ch)
        return None
    if kind == "obj":
        return _step_object(rest, top, ch)
    if kind == "key":
        _, schema, seen, buffer, depth = top
        if ch == '"':
            allowed = schema.keys is None and buffer and buffer not in seen
            if not (allowed or (schema.keys is not None and buffer in schema.keys and buffer not in seen)):
                return None
            return rest + (("obj", schema, seen | {buffer}, "colon", depth, buffer),)
        extended = buffer + ch
        if schema.keys is None:
            return rest + (("key", schema, seen, extended, depth),) if ch in KEY_CHARS and len(extended) <= 64 else None
        if any(k.startswith(extended) and k not in seen for k in schema.keys):
            return rest + (("key", schema, seen, extended, depth),)
        return None
    if kind == "arr":
        _, schema, count, phase, depth = top
        if ch in WHITESPACE:
            return frames
        limit = schema.int_option("maxItems", MAX_ITEMS)
        minimum = schema.int_option("minItems", 0)
        if phase in ("start", "after"):
            if ch == "]":
                return rest if count >= minimum else None
            if phase == "after":
                if ch == "," and count < limit:
                    return rest + (("arr", schema, count, "need", depth),)
                return None
        if count >= limit:
            return None
        # a value starts: the array frame waits behind it for "," or "]"
        return _start_value(rest + (("arr", schema, count + 1, "after", depth),), schema.child(None), depth + 1, ch)
    raise AssertionError(f"unknown frame {kind}")


def _step_object(rest: tuple, top: tuple, ch: str) -> tuple | None:
    schema, seen, phase, depth = top[1], top[2], top[3], top[4]
    if ch in WHITESPACE:
        return rest + (top,)
    remaining = (schema.keys is None and len(seen) < MAX_FREE_KEYS) or (
        schema.keys is not None and any(k not in seen for k in schema.keys))
    if phase == "colon":
        if ch != ":":
            return None
        key = top[5]
        return rest + (("obj", schema, seen, "after", depth), ("value", schema.child(key), depth + 1))
    if phase in ("start", "after") and ch == "}":
        return rest if schema.required <= seen else None
    if phase == "after":
        return rest + (("obj", schema, seen, "need", depth),) if ch == "," and remaining else None
    if ch == '"' and remaining:  # phase start or need: a key begins
        return rest + (("key", schema, seen, "", depth),)
    return None


def step(state: State, ch: str) -> State | None:
    """The state after character `ch`, or None when the text would stop being a valid prefix."""
    frames, run, total = state
    in_string = bool(frames) and frames[-1][0] in ("str", "key", "lit", "choice")
    if ch in WHITESPACE and not in_string:
        if ch not in WRITTEN_WHITESPACE or run >= MAX_WS_RUN or total >= MAX_WS_TOTAL:
            return None
        run, total = run + 1, total + 1
    else:
        run = 0
    frames = _step_frames(frames, ch)
    return None if frames is None else (frames, run, total)


def advance(state: State, text: str) -> State | None:
    """The state after `text`, or None."""
    for ch in text:
        state = step(state, ch)
        if state is None:
            return None
    return state


def is_complete(state: State) -> bool:
    """The output is one whole JSON object (nothing may follow)."""
    return not state[0]


@dataclass
class TokenTexts:
    """The text each token id adds when it follows ordinary text; None for special tokens,
    empty texts and partial UTF-8 (which constrained output never uses)."""

    texts: list[str | None]

    @classmethod
    def for_tokenizer(cls, tokenizer) -> TokenTexts:
        backend = tokenizer.backend
        size = tokenizer.vocab_size
        anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]  # context so leading spaces survive decode
        base = tokenizer.decode(anchor)
        decoded = backend.decode_batch([anchor + [i] for i in range(size)], skip_special_tokens=False)
        special = set(backend.get_added_tokens_decoder())
        texts: list[str | None] = []
        for i, text in enumerate(decoded):
            piece = text[len(base):] if text.startswith(base) else None
            texts.append(None if i in special or not piece or "\ufffd" in piece else piece)
        return cls(texts)


def choose_token(logits: torch.Tensor, state: State, texts: TokenTexts, temperature: float = 0.0,
                 generator: torch.Generator | None = None, top: int = 64) -> tuple[int, State] | None:
    """The token to emit under the constraint and the state after it; None if no token fits.

    logits [1, V] or [V]. Greedy (temperature 0): the best-ranked valid token. Otherwise a
    draw, by the tempered distribution, among the valid tokens in the `top` best ranks
    (falling back to the best valid token further down).
    """
    row = logits.reshape(-1)[:len(texts.texts)].float()
    order = torch.argsort(row, descending=True).tolist()
    valid: list[tuple[int, State]] = []
    for rank, token in enumerate(order):
        text = texts.texts[token]
        if text is None:
            continue
        after = advance(state, text)
        if after is None:
            continue
        if temperature <= 0:
            return token, after
        valid.append((token, after))
        if rank >= top and valid:
            break
    if not valid:
        return None
    if len(valid) == 1:
        return valid[0]
    chosen = row[[t for t, _ in valid]].float()
    weights = torch.softmax((chosen - chosen.max()) / temperature, dim=0)  # shifted: no inf - inf at tiny temperatures
    pick = int(torch.multinomial(weights, 1, generator=generator))
    return valid[pick]


def validate_arguments(arguments: Any, schema: dict) -> bool:
    """Whether `arguments` (a decoded object) re-serialised passes the constraint (a cheap schema check)."""
    if not isinstance(arguments, dict):
        return False
    state = advance(initial_state(schema), json.dumps(arguments, ensure_ascii=False))
    return state is not None and is_complete(state)


def complete_prefixes(schema: dict, texts: Sequence[str]) -> list[bool]:
    """For each text: whether it is a whole valid object under `schema` (test helper)."""
    results = []
    for text in texts:
        state = advance(initial_state(schema), text)
        results.append(state is not None and is_complete(state))
    return results
