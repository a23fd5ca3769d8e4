"""Kimi K3's XTML chat format (MODELS.md, "Chat format XTML").

Every element is `<|open|>TAG ATTRS<|sep|> body <|close|>TAG<|sep|>`; a message ends with
`<|end_of_msg|>`, the stop token. An assistant message holds a think channel (reasoning),
a response channel (content) and optionally a tools section:

    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>R<|close|>think<|sep|>
    <|open|>response<|sep|>C<|close|>response<|sep|>
    <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>
    <|open|>argument key="k" type="string"<|sep|>v<|close|>argument<|sep|>
    <|open|>argument key="n" type="json"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>
    <|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>

Tools are declared in a `role="system" type="tool-declare"` message (the JSON list as
given), the effort tier in a `role="system" type="thinking-effort"` message (low | high |
max; max when none is given), tool results are `role="tool" tool="f" index="i"` messages.
Earlier reasoning is rendered back into each assistant message's think channel.

Structural tokens are ids and every text piece is encoded on its own (segments.Pieces), so
text can never turn into markup. Attribute values escape `&` as `&amp;` and `"` as
`&quot;` (nothing else); bodies are raw text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from localmoe.chat.format import ChatMessage, Delta, ParsedReply, StreamParser, ToolCall
from localmoe.chat.images import KIMI_MEDIA, ImageRef, media_ids, message_pieces
from localmoe.chat.segments import EventStream, Pieces, parse_ids
from localmoe.chat.validate import check_effort, check_messages, check_tools, tool_result_names

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
DEFAULT_EFFORT = "max"

_ATTR = re.compile(r'([^\s="]+)="([^"]*)"')
_ENTITY = re.compile(r"&(amp|quot);")


def escape_attr(value: str) -> str:
    """An attribute value as written between double quotes."""
    return value.replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    """Inverse of escape_attr (one pass, so "&amp;quot;" gives "&quot;")."""
    return _ENTITY.sub(lambda m: "&" if m[1] == "amp" else '"', value)


def tag_header(name: str, **attrs: str) -> str:
    """`name key="value" ...` with escaped values, in the given order."""
    return " ".join([name, *(f'{key}="{escape_attr(value)}"' for key, value in attrs.items())])


def parse_header(header: str) -> tuple[str, dict[str, str]]:
    """(tag name, attributes) of the text between `<|open|>` and `<|sep|>`."""
    name, _, rest = header.strip().partition(" ")
    return name, {key: unescape_attr(value) for key, value in _ATTR.findall(rest)}


class XtmlFormat:
    """ChatFormat for Kimi K3 (see the module docstring for the layout)."""

    name = "xtml"
    thinks = True

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pieces = Pieces(tokenizer, (OPEN, CLOSE, SEP, END), "XTML")
        ids = self.pieces.ids
        self.open, self.close, self.sep, self.end = ids[OPEN], ids[CLOSE], ids[SEP], ids[END]
        self._stops = {self.end} | set(tokenizer.stop_token_ids)
        self._structural = {self.open, self.close, self.sep} | self._stops

    # -- rendering -----------------------------------------------------------------------

    def _start(self, header: str) -> list[str | int]:
        return [self.open, header, self.sep]

    def _stop(self, name: str) -> list[str | int]:
        return [self.close, name, self.sep]

    def _message(self, body: list[str | int], **attrs: str) -> list[str | int]:
        return [*self._start(tag_header("message", **attrs)), *body, *self._stop("message"), self.end]

    def _calls(self, calls: list[ToolCall]) -> list[str | int]:
        out: list[str | int] = [*self._start("tools")]
        for index, call in enumerate(calls, 1):
            out += self._start(tag_header("call", tool=call.name, index=str(index)))
            if call.raw_arguments is not None:  # what the model wrote when it was not an object, as it was
                out += [*self._start(tag_header("arguments", type="json")), call.raw_arguments, *self._stop("arguments")]
            for key, value in call.arguments.items():
                if isinstance(value, str):
                    kind, text = "string", value
                else:
                    kind, text = "json", json.dumps(value, ensure_ascii=False)
                out += [*self._start(tag_header("argument", key=str(key), type=kind)), text, *self._stop("argument")]
            out += self._stop("call")
        return out + self._stop("tools")

    def _reply(self, message: ChatMessage) -> list[str | int]:
        """Everything of an assistant message after the generation prompt, `<|end_of_msg|>` included."""
        out: list[str | int] = [message.reasoning or "", *self._stop("think"),
                                *self._start("response"), message.content, *self._stop("response")]
        if message.tool_calls:
            out += self._calls(message.tool_calls)
        return [*out, *self._stop("message"), self.end]

    def _image(self, ref: ImageRef) -> list[str | int]:
        """`<|media_begin|>image WxH<|media_content|><|media_pad|>...<|media_end|>`: one pad per tower row."""
        begin, content, pad, end = media_ids(self.tokenizer, KIMI_MEDIA, "XTML")
        return [begin, f"image {ref.width}x{ref.height}", content, *[pad] * ref.tokens, end]

    def _generation_prompt(self) -> list[str | int]:
        return [*self._start(tag_header("message", role="assistant")), *self._start("think")]

    def render(self, messages: Iterable[ChatMessage], *, tools: list[dict] | None = None,
               reasoning_effort: str | None = None, add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids: tool declarations, the effort tier, the messages, then the generation prompt."""
        messages = check_messages(messages)
        tools = check_tools(tools)
        effort = check_effort(reasoning_effort) or DEFAULT_EFFORT
        pieces: list[str | int] = []
        if tools:
            pieces += self._message([json.dumps(tools, ensure_ascii=False)], role="system", type="tool-declare")
        pieces += self._message([effort], role="system", type="thinking-effort")
        results = iter(tool_result_names(messages))
        for m in messages:
            if m.role == "assistant":
                pieces += self._generation_prompt() + self._reply(m)
            elif m.role == "tool":
                name, index = next(results)
                pieces += self._message([m.content], role="tool", tool=name, index=str(index))
            else:
                pieces += self._message(message_pieces(m, self._image), role=m.role)
        if add_generation_prompt:
            pieces += self._generation_prompt()
        return self.pieces.build(pieces)

    def render_reply(self, message: ChatMessage) -> list[int]:
        """The ids a model writes for `message` after the generation prompt, stop token included."""
        return self.pieces.build(self._reply(check_messages([message])[0]))

    # -- reading -------------------------------------------------------------------------

    def stop_token_ids(self) -> set[int]:
        """`<|end_of_msg|>` plus the tokenizer's own end-of-generation ids."""
        return set(self._stops)

    def end_of_thinking_ids(self) -> list[int]:
        """`<|close|>think<|sep|><|open|>response<|sep|>`."""
        return self.pieces.build([*self._stop("think"), *self._start("response")])

    def parse(self, token_ids: list[int]) -> ParsedReply:
        """Reasoning, content and tool calls of one generated assistant turn."""
        return parse_ids(self.tokenizer, self._structural, _Reader(self), token_ids)

    def stream_parser(self) -> StreamParser:
        """A fresh incremental parser for one assistant turn."""
        return EventStream(self.tokenizer, self._structural, _Reader(self))


class _Reader:
    """Interprets XTML events of one assistant turn; the generation prompt opened message and think."""

    def __init__(self, fmt: XtmlFormat):
        self._fmt = fmt
        self._stack: list[str] = ["message", "think"]
        self._header: list[str] | None = None  # text since <|open|> or <|close|>, until <|sep|>
        self._closing = False
        self._call: ToolCall | None = None
        self._argument: tuple[str, str] | None = None  # (key, type) of the open argument
        self._value: list[str] = []
        self._done = False
        self.reply = ParsedReply()

    def special(self, token_id: int) -> list[Delta]:
        fmt = self._fmt
        if self._done:
            return []
        if token_id in (fmt.open, fmt.close):
            self._header, self._closing = [], token_id == fmt.close
        elif token_id == fmt.sep:
            if self._header is not None:
                header, self._header = "".join(self._header), None
                return self._end_tag(header.strip()) if self._closing else self._start_tag(header)
        else:  # a stop token
            self._done = True
        return []

    def text(self, text: str) -> list[Delta]:
        if self._done:
            return []
        if self._header is not None:
            self._header.append(text)
            return []
        top = self._stack[-1] if self._stack else None
        if top == "think":
            self.reply.reasoning += text
            return [Delta("reasoning", text)]
        if top == "response":
            self.reply.content += text
            return [Delta("content", text)]
        if top in ("argument", "arguments"):
            self._value.append(text)
        return []  # text between elements is not part of the reply

    def _start_tag(self, header: str) -> list[Delta]:
        name, attrs = parse_header(header)
        if name == "message":  # the turn is one message: the model went on to write another (a tool result...)
            self._done = True
            return []
        if name == "think" and "think" in self._stack:
            return []  # the model repeated the think tag the generation prompt opened
        if name == "call":
            self._call = ToolCall(name=attrs.get("tool", ""), arguments={})
        elif name in ("argument", "arguments"):
            self._argument, self._value = (attrs.get("key", ""), attrs.get("type", "string")), []
        self._stack.append(name)
        return []

    def _end_tag(self, name: str) -> list[Delta]:
        if name not in self._stack:
            return []  # a stray close tag
        deltas: list[Delta] = []
        while self._stack:
            top = self._stack.pop()
            if top == "argument" or top == "arguments":
                self._end_argument(top)
            elif top == "call" and self._call is not None:
                self.reply.tool_calls.append(self._call)
                deltas.append(Delta("tool", tool_call=self._call))
                self._call = None
            elif top == "message":
                self._done = True
            if top == name:
                break
        return deltas

    def _end_argument(self, tag: str) -> None:
        if self._call is None or self._argument is None:
            return
        (key, kind), text = self._argument, "".join(self._value)
        self._argument = None
        if tag == "arguments":  # the whole object at once (the template's fallback for non-dict arguments)
            try:
                value = json.loads(text)
            except ValueError:
                value = None
            if isinstance(value, dict):
                self._call.arguments.update(value)
            else:
                self._call.raw_arguments = text
            return
        value = text
        if kind == "json":
            try:
                value = json.loads(text)
            except ValueError:
                pass  # not JSON after all: keep the text
        self._call.arguments[key] = value

    def finish(self) -> list[Delta]:
        return []  # a call still open (generation cut off) is left out
