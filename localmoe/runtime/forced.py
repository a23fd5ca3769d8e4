"""Forced tool calls (`tool_choice` required or a named function), made reliable by
constraining the arguments to valid JSON for the tool's schema (chat/grammar.py).

The format itself says how a call looks: the conversation is rendered once with a
placeholder call appended (`SENTINEL_NAME` with `{SENTINEL_KEY: ...}` as arguments) and
the assistant-turn tokens before the placeholder's name are injected as they are. From
there the output is constrained to the rendered text between name and arguments, with the
name chosen among the allowed tools, and then one JSON object of the chosen tool's
schema. With one allowed name, everything up to the arguments is injected, special tokens
included (harmony: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`).
Where the placeholder cannot be found (a format whose arguments are not JSON, such as
XTML's typed argument elements), or several names are allowed and special tokens sit
between name and arguments, the object is generated right after the generation prompt;
the call still enters the history in the format's own markup.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from localmoe.chat.format import ChatMessage, ToolCall
from localmoe.chat.grammar import tool_call_grammar

SENTINEL_NAME = "zzlocalmoe_tool_name"
SENTINEL_KEY = "zzlocalmoe_arguments"
SENTINEL_VALUE = "zzlocalmoe_value"


@dataclass
class ForcedPlan:
    """What to inject, then what the constrained output must be."""

    inject: list[int]  # assistant-turn ids after the generation prompt, before the constrained text
    segments: list  # literal strings and tuples of name options, before the JSON object
    names: list[str]  # the allowed tool names
    schemas: dict[str, dict] = field(default_factory=dict)

    def grammar(self) -> str:
        """The constrained text's grammar: segments (the name chosen among `names`), then the tool's arguments."""
        if any(isinstance(s, tuple) for s in self.segments):
            return tool_call_grammar(self.segments, {n: self.schemas[n] for n in self.names})
        return tool_call_grammar(self.segments, {self.names[0]: self.schemas[self.names[0]]})

    def split(self, text: str) -> tuple[str, str] | None:
        """(tool name, argument text) from the constrained output `text`."""
        position = 0
        name = self.names[0] if len(self.names) == 1 else None
        for segment in self.segments:
            if isinstance(segment, str):
                if not text.startswith(segment, position):
                    return None
                position += len(segment)
            else:
                matches = [o for o in segment if text.startswith(o, position)]
                if not matches:
                    return None
                name = max(matches, key=len)
                position += len(name)
        return (name, text[position:]) if name else None


def tool_schemas(tools: list[dict], names: list[str]) -> dict[str, dict]:
    out = {}
    for tool in tools:
        function = tool.get("function", {})
        if function.get("name") in names:
            parameters = function.get("parameters")
            out[function["name"]] = parameters if isinstance(parameters, dict) else {"type": "object"}
    return out


def plan_forced_call(fmt, tokenizer, messages: list[ChatMessage], tools: list[dict], names: list[str],
                     prompt: list[int], reasoning_effort: str | None) -> ForcedPlan:
    """How to force a call of one of `names` after `prompt` (the rendered conversation)."""
    schemas = tool_schemas(tools, names)
    arguments = {SENTINEL_KEY: SENTINEL_VALUE}
    # the call as the format writes an arguments object; then as it writes arguments it holds as JSON text
    # (XTML writes an object key by key, typed, but keeps such text whole in one `arguments type="json"`)
    for call in (ToolCall(SENTINEL_NAME, arguments), ToolCall(SENTINEL_NAME, {}, raw_arguments=json.dumps(arguments))):
        plan = _plan_from_placeholder(fmt, tokenizer, messages, tools, names, prompt, reasoning_effort, call, schemas)
        if plan is not None:
            return plan
    return ForcedPlan(inject=[], segments=[], names=names[:1], schemas=schemas)  # no name slot: the first


def _plan_from_placeholder(fmt, tokenizer, messages, tools, names, prompt, reasoning_effort, call: ToolCall,
                           schemas) -> ForcedPlan | None:
    placeholder = ChatMessage("assistant", "", tool_calls=[call])
    try:
        full = fmt.render([*messages, placeholder], tools=tools, reasoning_effort=reasoning_effort,
                          add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a format that cannot render the placeholder: fall back
        return None
    if full[:len(prompt)] != prompt:
        return None
    tail = full[len(prompt):]
    text = tokenizer.decode(tail)
    key_at = text.find(json.dumps(SENTINEL_KEY))
    name_at = text.find(SENTINEL_NAME)
    if key_at < 0 or name_at < 0 or name_at > key_at:
        return None
    brace = text.rfind("{", 0, key_at)
    if brace < name_at or text[brace + 1:key_at].strip():
        return None
    # inject up to the last token boundary before the name; the rest is constrained text
    cut, boundary = 0, 0
    for k in range(1, len(tail) + 1):
        decoded = tokenizer.decode(tail[:k])
        if len(decoded) > name_at or not text.startswith(decoded):
            break
        cut, boundary = k, len(decoded)
    if len(names) == 1:
        opening = _ids_through(tokenizer, tail, name_at, brace, names[0])
        if opening is not None:
            return ForcedPlan(inject=opening, segments=[], names=names, schemas=schemas)
    segments = [s for s in (text[boundary:name_at], tuple(names), text[name_at + len(SENTINEL_NAME):brace]) if s]
    specials = [t for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special]
    if any(t.content in s for t in specials for s in segments if isinstance(s, str)):
        return None  # markup between name and arguments is special tokens, which constrained text cannot write
    return ForcedPlan(inject=list(tail[:cut]), segments=segments, names=names, schemas=schemas)


def _ids_through(tokenizer, tail: list[int], name_at: int, brace: int, name: str) -> list[int] | None:
    """The call's opening as ids, up to its arguments' `{`, with the placeholder name replaced by `name`.

    `tail` renders the placeholder call; the placeholder name spans text[name_at:name_at + len]
    and the brace sits at text[brace]. Needs token boundaries at those three places (else None).
    """
    lengths = [len(tokenizer.decode(tail[:k])) for k in range(len(tail) + 1)]
    cuts = []
    for at in (name_at, name_at + len(SENTINEL_NAME), brace):
        if at not in lengths:
            return None
        cuts.append(lengths.index(at))
    before, after, end = cuts
    return tail[:before] + tokenizer.encode(name, add_special_tokens=False) + tail[after:end]
