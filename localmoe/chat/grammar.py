"""Constrained decoding through one grammar engine, llguidance: JSON Schema output
(`response_format`, Responses `text.format`, Anthropic `output_config.format`) and
tool-call arguments (forced calls) are grammars; at each step the engine's token mask
removes every token that would leave the grammar, and the ordinary sampler draws from
what is left, so the output is valid at any temperature.

llguidance was measured against xgrammar and the hand-written character validator it
replaces (benchmarks/grammar_mask.py, docs/performance.md): both libraries cost
microseconds per token where the validator cost tens of milliseconds, and llguidance
has no dependencies, compiles a schema in under a millisecond and composes grammars
(the forced call's literal opening, its choice of name, then that tool's schema).

JSON is written with fixed separators (", " and ": ") and no other whitespace, so a
constrained generation cannot run on in blanks, and object keys come in the schema's
order (as OpenAI's structured outputs write them). Tool arguments keep the bounds forced
calls always had (`bounded`): strings and arrays without a declared limit are capped, so
a call ends within a few dozen tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from localmoe.errors import LocalMoEError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_STRING = 48  # tool-argument string characters without maxLength
MAX_ITEMS = 16  # tool-argument array items without maxItems


class GrammarError(LocalMoEError):
    """A schema or grammar the engine cannot compile; the message names the field."""


def _llguidance():
    try:
        import llguidance
        import llguidance.torch  # the bitmask helpers
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise GrammarError("structured output needs the llguidance package: pip install llguidance") from e
    return llguidance


class GrammarTokenizer:
    """The engine's view of a localmoe Tokenizer (built once per served model, ~0.5-2 s)."""

    def __init__(self, tokenizer, stop_ids: Sequence[int] = ()):
        llg = _llguidance()
        stops = sorted(stop_ids) or sorted(tokenizer.stop_token_ids)
        eos = stops[0] if stops else tokenizer.eos_token_id
        self.vocab_size = tokenizer.vocab_size
        self.eos = eos
        try:
            self.llt = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
        except Exception as e:  # noqa: BLE001 - whatever the engine rejects in a tokenizer, say what and where
            raise GrammarError(f"the grammar engine cannot read this model's tokenizer ({e}); structured "
                               f"output and forced tool calls are unavailable for it") from None


def json_schema_grammar(schema: dict, where: str = "schema") -> str:
    """The grammar of one JSON value valid against `schema`."""
    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be a JSON schema object")
    try:
        return _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{where} is not a JSON schema the grammar engine accepts: {e}") from None


def json_object_grammar() -> str:
    """Any JSON object (`response_format: {"type": "json_object"}`)."""
    return json_schema_grammar({"type": "object"})


def _rewrite(schema: Any, fix) -> Any:
    """A copy of `schema` with `fix(subschema)` applied to it and to every schema nested in it."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("items", "additionalProperties", "not"):
        if key in out:
            out[key] = _rewrite(out[key], fix)
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: _rewrite(sub, fix) for name, sub in out[key].items()}
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [_rewrite(sub, fix) for sub in out[key]]
    fix(out)
    return out


def _types(schema: dict) -> set[str]:
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    return {t for t in declared if isinstance(t, str)} if isinstance(declared, list) else set()


def _close(schema: dict) -> None:
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        schema["additionalProperties"] = False


def _cap(schema: dict) -> None:
    _close(schema)
    types = _types(schema)
    if "string" in types and not {"maxLength", "enum", "const", "pattern", "format"} & schema.keys():
        schema["maxLength"] = MAX_STRING
    if "array" in types and "maxItems" not in schema:
        schema["maxItems"] = MAX_ITEMS


def closed(schema: dict) -> dict:
    """A copy of `schema` whose objects take only their declared properties unless they say
    otherwise (`additionalProperties`), as OpenAI's strict mode reads a schema."""
    return _rewrite(schema, _close)


def bounded(schema: dict) -> dict:
    """`closed(schema)`, with strings and arrays capped where it declares no limit (tool arguments)."""
    return _rewrite(schema, _cap)


def tool_call_grammar(segments: Sequence[str | tuple[str, ...]], schemas: dict[str, dict]) -> str:
    """A forced call's constrained text: literal `segments` (a tuple: exactly one of those tool
    names), then one JSON object of the chosen tool's (bounded) schema."""
    names = next((s for s in segments if isinstance(s, tuple)), None)
    rules: list[str] = []
    if names is None:
        (only,) = schemas
        body = " ".join([*(json.dumps(s) for s in segments if s), "args0"])
        rules.append(f"args0: %json {json.dumps(_object(schemas[only]))}")
    else:
        at = segments.index(names)
        before = [json.dumps(s) for s in segments[:at] if s]
        after = [json.dumps(s) for s in segments[at + 1:] if s]
        options = []
        for i, name in enumerate(names):
            options.append(" ".join([json.dumps(name), *after, f"args{i}"]))
            rules.append(f"args{i}: %json {json.dumps(_object(schemas[name]))}")
        body = " ".join([*before, "(" + " | ".join(options) + ")"])
    lark = "\n".join([f"start: {body}", *rules])
    try:
        return _llguidance().LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the tools' parameters do not compile to a grammar: {e}") from None


def _object(schema: dict | None) -> dict:
    root = bounded(schema or {})
    root["type"] = "object"
    root.setdefault("x-guidance", JSON_OPTIONS)
    return root


class Constraint:
    """One generation's grammar state: `mask` the logits, `consume` the token drawn, `done` at the end."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str):
        self._llg = llg = _llguidance()
        self.tokenizer = tokenizer
        self.matcher = llg.LLMatcher(tokenizer.llt, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the output schema does not compile: {self.matcher.get_error()}")
        self._bitmask = llg.torch.allocate_token_bitmask(1, tokenizer.vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` [1, V'] with every token the grammar forbids at -inf (ids past the tokenizer too)."""
        self._llg.torch.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        row = logits.float().reshape(1, -1)
        width, vocab = row.shape[1], self.tokenizer.vocab_size
        out = torch.full((1, max(width, vocab)), float("-inf"))
        out[:, :min(width, vocab)] = row[:, :vocab]  # ids past the tokenizer, or missing from the head: impossible
        self._llg.torch.apply_token_bitmask_inplace(out[:, :vocab], self._bitmask)
        return out[:, :width]

    def consume(self, token: int) -> None:
        """Advance by the token drawn from the masked logits."""
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} does not continue the constrained output: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The output is complete: only the end of the turn may follow."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """What was written so far is a complete value (the turn may end here)."""
        return self.matcher.is_accepting()
