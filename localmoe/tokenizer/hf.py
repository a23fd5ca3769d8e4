"""Build the tokenizer of a Hugging Face model directory.

Read: `tokenizer.json` (required), `tokenizer_config.json` (special tokens, add_bos_token,
add_eos_token, chat_template), `special_tokens_map.json` (special tokens, when the config
lacks them), `chat_template.jinja` / `chat_template.json` (the chat template, preferred over
the config's, as transformers does) and `generation_config.json` (its eos_token_id, an id or
a list of ids, joins the stop ids).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

from localmoe.errors import TokenizerError
from localmoe.tokenizer.base import Tokenizer, bos_eos_processor

_NAMED = ("bos_token", "eos_token", "pad_token", "unk_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path} cannot be read as JSON ({e}); fix or delete the file") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} holds a {type(data).__name__}, not a JSON object; fix or delete the file")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(directory / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def tokenizer_from_hf_dir(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer stored in the Hugging Face model directory `path`."""
    directory = Path(path)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise TokenizerError(f"{directory} has no tokenizer.json; download it with the model, or use a GGUF file")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # noqa: BLE001 - the Rust side reports any parse failure as Exception
        raise TokenizerError(f"{tokenizer_file} cannot be loaded ({e}); download it again") from None
    config = _read_json(directory / "tokenizer_config.json")
    special_map = _read_json(directory / "special_tokens_map.json")
    generation = _read_json(directory / "generation_config.json")

    texts = {name: _token_text(config.get(name)) or _token_text(special_map.get(name)) for name in _NAMED}
    # Named special tokens are matched whole, and one missing from tokenizer.json gets a new id (as in transformers).
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in texts.values() if t])
    ids = {name: backend.token_to_id(text) if text else None for name, text in texts.items()}
    eos_ids = generation.get("eos_token_id")
    eos_ids = [eos_ids] if isinstance(eos_ids, int) else [i for i in eos_ids or () if isinstance(i, int)]
    if ids["eos_token"] is None and eos_ids:
        ids["eos_token"] = eos_ids[0]
    if ids["bos_token"] is None and isinstance(generation.get("bos_token_id"), int):
        ids["bos_token"] = generation["bos_token_id"]

    # transformers rebuilds the post-processor when the config sets add_bos_token/add_eos_token
    # (or tokenizer.json has none); otherwise tokenizer.json's own post-processor decides.
    if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
        def added(name: str, flag: str) -> tuple[str, int] | None:
            i = ids[name]
            return (backend.id_to_token(i), i) if config.get(flag) and i is not None else None

        backend.post_processor = bos_eos_processor(added("bos_token", "add_bos_token"),
                                                   added("eos_token", "add_eos_token"))

    return Tokenizer(backend, source=directory.name or str(directory), bos_token_id=ids["bos_token"],
                     eos_token_id=ids["eos_token"], pad_token_id=ids["pad_token"], unk_token_id=ids["unk_token"],
                     extra_stop_ids=eos_ids, chat_template=_chat_template(directory, config))
