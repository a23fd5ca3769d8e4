"""What the paging commands (trace, calibrate, plan) share: sizes, opening a paged model, prompts."""

from __future__ import annotations

import re

from localmoe.errors import LocalMoEError

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int, total: int | None = None) -> int:
    """Bytes from "8G", "512M", "123456" or "25%" (of `total`)."""
    if isinstance(text, int):
        return text
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    if s.endswith("%"):
        if total is None:
            raise LocalMoEError(f"{text!r}: a percentage needs a total to be a fraction of")
        return int(total * float(s[:-1]) / 100)
    m = re.fullmatch(r"([0-9.]+)\s*([kmgt]?)", s)
    if not m:
        raise LocalMoEError(f"{text!r} is not a size (examples: 8G, 512M, 25%)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def open_paged(store_path: str, paging, threads: int = 0, trace=None):
    """(loaded model, its Pager or None) for a packed store, experts placed as `paging` (a PagingConfig)
    says, weights in float32; `trace` (a RoutingTrace) records every router's choices."""
    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.paging import attach
    from localmoe.paging.metrics import pager_of

    loaded = load_model(store_path, EngineConfig(dtype="float32", threads=threads, paging=paging), progress=False)
    pager = pager_of(loaded.model)
    if trace is not None:  # the routers rewrapped, recording as well as paging
        attach(loaded.model, pager, trace=trace, lookahead=pager is not None and pager.prefetch_enabled)
    return loaded, pager


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of `prompt`: "ids:1,2,3" literally, else the model's tokenizer."""
    if prompt.startswith("ids:"):
        return [int(x) for x in prompt[4:].split(",") if x.strip()]
    ids = tokenizer.encode(prompt)
    if not ids:
        raise LocalMoEError("the prompt is empty")
    return ids


def greedy(loaded, ids: list[int], max_tokens: int):
    """The runtime's greedy completion of `ids` (up to `max_tokens` tokens; an end-of-turn token ends it)."""
    from localmoe.engine.sampler import SamplingParams
    from localmoe.runtime.local import LocalModel

    return LocalModel(loaded).complete(ids, SamplingParams(temperature=0.0), max_tokens)
