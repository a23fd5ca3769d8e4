"""OpenAI function declarations as harmony's TypeScript-like `namespace functions { ... }` block.

    namespace functions {

    // Gets the weather.
    type get_weather = (_: {
    // The city
    city: string,
    unit?: "celsius" | "fahrenheit", // default: celsius
    }) => any;

    // Takes no arguments.
    type ping = () => any;

    } // namespace functions

JSON Schema types map to TypeScript: string, number/integer -> number, boolean, null,
arrays -> `T[]`, enums and `const` -> literal unions, anyOf/oneOf -> unions, objects with
properties -> `{ ... }` (optional keys get `?`), anything else -> `any`.
"""

from __future__ import annotations

import json
from typing import Any

_SCALARS = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null"}


def ts_type(schema: Any) -> str:
    """The TypeScript type of a JSON Schema."""
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema and isinstance(schema["enum"], list):
        return " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"]) or "any"
    if "const" in schema:
        return json.dumps(schema["const"], ensure_ascii=False)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return " | ".join(ts_type(s) for s in schema[key]) or "any"
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(ts_type({**schema, "type": k}) for k in kind) or "any"
    if kind == "array":
        item = ts_type(schema.get("items"))
        return f"({item})[]" if " | " in item else f"{item}[]"
    if kind == "object" or (kind is None and "properties" in schema):
        if not schema.get("properties"):
            return "object"
        return "{\n" + _properties(schema) + "}"
    return _SCALARS.get(kind, "any")


def _properties(schema: dict) -> str:
    required = set(schema.get("required") or ())
    lines = []
    for name, prop in schema["properties"].items():
        prop = prop if isinstance(prop, dict) else {}
        if prop.get("description"):
            lines += [f"// {line}" for line in str(prop["description"]).splitlines()]
        optional = "" if name in required else "?"
        default = f" // default: {_default(prop['default'])}" if "default" in prop else ""
        lines.append(f"{name}{optional}: {ts_type(prop)},{default}")
    return "".join(line + "\n" for line in lines)


def _default(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def function_declaration(function: dict) -> str:
    """`// description` + `type NAME = (_: {...}) => any;` for one `function` object."""
    lines = [f"// {line}" for line in str(function.get("description") or "").splitlines()]
    params = function.get("parameters")
    if isinstance(params, dict) and params.get("properties"):
        lines.append(f"type {function['name']} = (_: {ts_type(params)}) => any;")
    else:
        lines.append(f"type {function['name']} = () => any;")
    return "\n".join(lines)


def functions_namespace(tools: list[dict]) -> str:
    """The `namespace functions { ... }` block for OpenAI-style tool declarations."""
    body = "".join(function_declaration(tool["function"]) + "\n\n" for tool in tools)
    return f"namespace functions {{\n\n{body}}} // namespace functions"
