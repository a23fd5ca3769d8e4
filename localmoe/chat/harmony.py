"""gpt-oss's harmony chat format (the public openai-harmony spec).

A message is `<|start|>{header}<|message|>{body}<|end|>`; the header is the role, then
optionally ` to={recipient}`, `<|channel|>{channel}` and `<|constrain|>{content type}`:

    <|start|>system<|message|>You are ChatGPT, ...\\nReasoning: high\\n\\n# Valid channels: ...<|end|>
    <|start|>developer<|message|># Instructions\\n\\n{system text}\\n\\n# Tools\\n\\n## functions\\n\\n
        namespace functions { ... } // namespace functions<|end|>
    <|start|>user<|message|>...<|end|>
    <|start|>assistant<|channel|>analysis<|message|>{reasoning}<|end|>
    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{args}<|call|>
    <|start|>functions.f to=assistant<|channel|>commentary<|message|>{result}<|end|>
    <|start|>assistant<|channel|>final<|message|>{content}<|end|>     (`<|return|>` when generated)

Effort: our low / high / max render as `Reasoning: low / medium / high` (None: medium,
harmony's default). The system messages at the start of a conversation become the
developer message's instructions (with the tools); a later system message becomes a
developer message where it stands. An assistant message's content goes to `final`, or,
when it makes tool calls, to a `commentary` preamble before them.

Past reasoning follows harmony's rule: analysis messages up to the last `final` message
are dropped, so only the reasoning of the tool-calling turn in progress is rendered back.
`keep_reasoning=True` renders every turn's reasoning instead (DESIGN.md's full history;
gpt-oss was not trained on that). Reading accepts a recipient in the role part of the
header (`<|start|>assistant to=functions.f<|channel|>commentary json<|message|>`) and tool
calls on the analysis channel, as the models produce both; a commentary message without a
recipient is content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from localmoe.chat.format import ChatFormatError, ChatMessage, Delta, ParsedReply, StreamParser, ToolCall
from localmoe.chat.harmony_tools import functions_namespace
from localmoe.chat.segments import EventStream, Pieces, parse_ids
from localmoe.chat.validate import check_effort, check_messages, check_tools, tool_result_names

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
EFFORTS = {None: "medium", "low": "low", "high": "medium", "max": "high"}
IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
_RECIPIENT = re.compile(r"\bto=(\S+)")


class HarmonyFormat:
    """ChatFormat for gpt-oss (see the module docstring for the layout and choices)."""

    name = "harmony"
    thinks = True

    def __init__(self, tokenizer, *, keep_reasoning: bool = False, model_identity: str = IDENTITY,
                 knowledge_cutoff: str | None = "2024-06", current_date: str | None = None):
        self.tokenizer = tokenizer
        self.keep_reasoning = keep_reasoning
        self.model_identity = model_identity
        self.knowledge_cutoff = knowledge_cutoff
        self.current_date = current_date  # "YYYY-MM-DD"; left out by default so prompts stay reproducible
        self.pieces = Pieces(tokenizer, (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN), "harmony")
        ids = self.pieces.ids
        self.ids = ids
        self._stops = {ids[CALL], ids[RETURN]} | set(tokenizer.stop_token_ids)
        self._structural = set(ids.values()) | self._stops

    # -- rendering -----------------------------------------------------------------------

    def _message(self, role: str, body: str, channel: str | None = None, constrain: str | None = None,
                 last: str = END) -> list[str | int]:
        ids = self.ids
        out: list[str | int] = [ids[START], role]
        if channel is not None:
            out += [ids[CHANNEL], channel]
        if constrain is not None:
            out += [ids[CONSTRAIN], constrain]
        return [*out, ids[MESSAGE], body, ids[last]]

    def _system(self, effort: str | None, tools: list[dict]) -> str:
        lines = [self.model_identity]
        if self.knowledge_cutoff:
            lines.append(f"Knowledge cutoff: {self.knowledge_cutoff}")
        if self.current_date:
            lines.append(f"Current date: {self.current_date}")
        text = "\n".join(lines) + f"\n\nReasoning: {EFFORTS[effort]}\n\n"
        text += "# Valid channels: analysis, commentary, final. Channel must be included for every message."
        if tools:
            text += "\nCalls to these tools must go to the commentary channel: 'functions'."
        return text

    @staticmethod
    def _developer(instructions: list[str], tools: list[dict]) -> str:
        parts = []
        if instructions:
            parts.append("# Instructions\n\n" + "\n\n".join(instructions))
        if tools:
            parts.append("# Tools\n\n## functions\n\n" + functions_namespace(tools))
        return "\n\n".join(parts)

    def _assistant(self, m: ChatMessage, reasoning: bool, generated: bool) -> list[str | int]:
        """An assistant message as messages; `generated`: as the model writes it (`<|return|>`)."""
        out: list[str | int] = []
        if reasoning and m.reasoning:
            out += self._message("assistant", m.reasoning, "analysis")
        if m.tool_calls:
            if m.content:
                out += self._message("assistant", m.content, "commentary")
            for call in m.tool_calls:
                arguments = call.raw_arguments if call.raw_arguments is not None else json.dumps(
                    call.arguments, ensure_ascii=False, separators=(",", ":"))
                out += self._message("assistant", arguments, f"commentary to=functions.{call.name} ", "json", CALL)
        else:
            out += self._message("assistant", m.content, "final", last=RETURN if generated else END)
        return out

    def render(self, messages: Iterable[ChatMessage], *, tools: list[dict] | None = None,
               reasoning_effort: str | None = None, add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids: system, developer (instructions + tools), the conversation, `<|start|>assistant`."""
        messages = check_messages(messages)
        tools = check_tools(tools)
        effort = check_effort(reasoning_effort)
        if any(m.images for m in messages):
            raise ChatFormatError("the harmony chat format (gpt-oss) has no image placeholder: this model reads text only")
        lead = 0
        while lead < len(messages) and messages[lead].role == "system":
            lead += 1
        pieces = self._message("system", self._system(effort, tools))
        if lead or tools:
            pieces += self._message("developer", self._developer([m.content for m in messages[:lead]], tools))
        last_final = max((i for i, m in enumerate(messages) if m.role == "assistant" and not m.tool_calls),
                         default=-1)
        results = iter(tool_result_names(messages))
        for i, m in enumerate(messages[lead:], lead):
            if m.role == "system":
                pieces += self._message("developer", self._developer([m.content], []))
            elif m.role == "user":
                pieces += self._message("user", m.content)
            elif m.role == "assistant":
                pieces += self._assistant(m, self.keep_reasoning or i > last_final, generated=False)
            else:
                name, _ = next(results)
                pieces += self._message(f"functions.{name} to=assistant", m.content, "commentary")
        if add_generation_prompt:
            pieces += [self.ids[START], "assistant"]
        return self.pieces.build(pieces)

    def render_reply(self, message: ChatMessage) -> list[int]:
        """The ids a model writes for `message` after `<|start|>assistant`, its stop token included."""
        pieces = self._assistant(check_messages([message])[0], True, generated=True)
        return self.pieces.build(pieces[2:])  # the generation prompt wrote the first <|start|>assistant

    # -- reading -------------------------------------------------------------------------

    def stop_token_ids(self) -> set[int]:
        """`<|return|>` and `<|call|>` plus the tokenizer's own end-of-generation ids."""
        return set(self._stops)

    def end_of_thinking_ids(self) -> list[int]:
        """Ends the analysis message and opens the final one."""
        ids = self.ids
        return self.pieces.build([ids[END], ids[START], "assistant", ids[CHANNEL], "final", ids[MESSAGE]])

    def parse(self, token_ids: list[int]) -> ParsedReply:
        """Reasoning (analysis), content (final, preambles) and tool calls of generated ids."""
        return parse_ids(self.tokenizer, self._structural, _Reader(self), token_ids)

    def stream_parser(self) -> StreamParser:
        """A fresh incremental parser for one assistant turn."""
        return EventStream(self.tokenizer, self._structural, _Reader(self))


def tool_call_from(recipient: str, body: str) -> ToolCall:
    """The call a message to `recipient` ("functions.f") with JSON `body` makes."""
    name = recipient.removeprefix("functions.")
    try:
        arguments = json.loads(body) if body.strip() else {}
    except ValueError:
        arguments = None
    if isinstance(arguments, dict):
        return ToolCall(name=name, arguments=arguments)
    return ToolCall(name=name, arguments={}, raw_arguments=body)


class _Reader:
    """Interprets harmony events of one assistant turn; the generation prompt wrote `<|start|>assistant`."""

    def __init__(self, fmt: HarmonyFormat):
        ids = fmt.ids
        self._ids = ids
        self._ends = {ids[END], ids[CALL], ids[RETURN]}
        self._stops = fmt._stops - self._ends
        self._header: dict[str, list[str]] | None = {"role": []}  # parts of the header being read
        self._part = "role"
        self._prompted = True  # reading the header the generation prompt opened with `<|start|>assistant`
        self._channel: str | None = None  # "reasoning" | "content" | "tool" while in a body
        self._recipient = ""
        self._body: list[str] = []
        self._done = False
        self.reply = ParsedReply()

    def special(self, token_id: int) -> list[Delta]:
        ids = self._ids
        if self._done:
            return []
        if token_id == ids[START]:
            self._header, self._part, self._channel, self._prompted = {"role": []}, "role", None, False
        elif token_id in (ids[CHANNEL], ids[CONSTRAIN]) and self._header is not None:
            self._part = "channel" if token_id == ids[CHANNEL] else "constrain"
            self._header.setdefault(self._part, [])
        elif token_id == ids[MESSAGE] and self._header is not None:
            self._begin_body(self._header)
            self._header = None
        elif token_id in self._ends:
            return self._end_message()
        elif token_id in self._stops:
            self._done = True
        return []

    def _begin_body(self, header: dict[str, list[str]]) -> None:
        role, channel = "".join(header["role"]), "".join(header.get("channel", []))
        found = _RECIPIENT.search(role) or _RECIPIENT.search(channel)
        self._recipient = found[1] if found else ""
        name = channel.split()[0] if channel.split() else ""
        # the generation prompt wrote the first header's author; later ones the model writes
        author = "assistant" if self._prompted or not role.split() else role.split()[0]
        if author != "assistant":  # a tool's, user's or system's message is never the model's to write: dropped
            self._channel = "ignored"
        elif self._recipient and self._recipient != "assistant":
            self._channel = "tool"
        else:
            self._channel = "reasoning" if name == "analysis" else "content"
        self._body = []

    def _end_message(self) -> list[Delta]:
        channel, self._channel, self._header = self._channel, None, None
        if channel != "tool":
            return []
        call = tool_call_from(self._recipient, "".join(self._body))
        self.reply.tool_calls.append(call)
        return [Delta("tool", tool_call=call)]

    def text(self, text: str) -> list[Delta]:
        if self._done:
            return []
        if self._header is not None:
            self._header[self._part].append(text)
        elif self._channel == "tool":
            self._body.append(text)
        elif self._channel == "reasoning":
            self.reply.reasoning += text
            return [Delta("reasoning", text)]
        elif self._channel == "content":
            self.reply.content += text
            return [Delta("content", text)]
        return []

    def finish(self) -> list[Delta]:
        if self._channel == "tool" and not self._done:
            return self._end_message()  # generation stopped at <|call|> and the stop token was not passed in
        return []
