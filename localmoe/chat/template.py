"""Render a Jinja chat template the way transformers' `apply_chat_template` does.

The environment matches Hugging Face's: a sandbox, `trim_blocks` and `lstrip_blocks`, the
`loopcontrols` extension, `raise_exception`, `strftime_now` and a `tojson` filter that keeps
non-ASCII text as is. `{% generation %}` blocks (used by HF to mark assistant tokens for
training masks) are accepted and render their body unchanged.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localmoe.errors import TokenizerError


class _TemplateRaised(Exception):
    """Raised by `raise_exception(...)` inside a template."""


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body: we need no assistant mask."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Not jinja's own tojson: that one escapes HTML characters and non-ASCII text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
                         tools: Sequence[Mapping[str, Any]] | None = None,
                         special_tokens: Mapping[str, str | None] | None = None,
                         source: str = "chat template", **extra: Any) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

    `special_tokens` holds the template variables naming special tokens (`bos_token`,
    `eos_token`, ...); `extra` adds any other variable a template reads (`enable_thinking`,
    `documents`, ...). `source` names where the template came from, for error messages.
    Raises TokenizerError when the template does not parse, fails, or calls `raise_exception`.
    """
    context: dict[str, Any] = {"bos_token": "", "eos_token": ""}
    context.update({name: value for name, value in (special_tokens or {}).items() if value is not None})
    context.update(extra)
    context.update(messages=[dict(m) for m in messages], tools=list(tools) if tools is not None else None,
                   add_generation_prompt=add_generation_prompt)
    try:
        return _compile(template).render(**context)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{source}: the chat template does not parse (line {e.lineno}): {e.message}; "
                             f"fix the template or pass one that works") from None
    except _TemplateRaised as e:
        raise TokenizerError(f"{source}: the chat template refused these messages: {e}") from None
    except Exception as e:  # noqa: BLE001 - jinja surfaces template bugs as any exception type
        raise TokenizerError(f"{source}: the chat template failed while rendering: "
                             f"{type(e).__name__}: {e}") from None
