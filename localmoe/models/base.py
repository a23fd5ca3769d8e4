"""What a model family declares: config parsers, tensor renaming rules, expected shapes.

A family is data plus a few small functions; the one loader (`localmoe/load.py`) applies
it. Canonical tensor names follow HF naming without the `model.` prefix, e.g.
`layers.3.self_attn.q_proj.weight`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from localmoe.config import ModelSpec

Transform = Callable[[torch.Tensor, ModelSpec], torch.Tensor]


@dataclass(frozen=True)
class TensorRule:
    """Checkpoint name pattern (with `{i}` for the layer index) -> canonical name, optional transform."""

    source: str
    target: str
    transform: Transform | None = None

    def compile(self) -> re.Pattern:
        return re.compile("^" + re.escape(self.source).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


@dataclass
class TensorMap:
    """An ordered set of rules plus names to ignore (e.g. `rotary_emb.inv_freq`)."""

    rules: tuple[TensorRule, ...]
    ignore: tuple[str, ...] = ()
    _compiled: list = field(default_factory=list, repr=False)

    def resolve(self, name: str) -> tuple[str, Transform | None] | None:
        """Canonical name and transform for a checkpoint tensor; None if it is ignored.

        Raises KeyError for a tensor no rule knows, so unexpected checkpoints fail loudly.
        """
        if not self._compiled:
            self._compiled = [(rule.compile(), rule) for rule in self.rules]
        for pattern, rule in self._compiled:
            match = pattern.match(name)
            if match:
                target = rule.target.replace("{i}", match.group("i")) if "i" in match.groupdict() else rule.target
                return target, rule.transform
        if any(re.search(p, name) for p in self.ignore):
            return None
        raise KeyError(name)


@dataclass(frozen=True)
class Family:
    """One model family: how to read its configs and tensors, and how to build it."""

    name: str
    model_types: tuple[str, ...]  # HF config.json `model_type` values
    gguf_architectures: tuple[str, ...]  # GGUF `general.architecture` values
    spec_from_hf: Callable[[dict], ModelSpec]
    spec_from_gguf: Callable[[dict, set], ModelSpec] | None  # (metadata, tensor names)
    hf_tensors: TensorMap
    gguf_tensors: Callable[[str], TensorMap] | None  # by GGUF architecture (permutations differ)
    expected_shapes: Callable[[ModelSpec], dict[str, tuple[int, ...]]]
    optional_tensors: tuple[str, ...] = ()  # canonical-name regexes that may be absent (e.g. a tied lm_head)
    build: Callable | None = None  # (spec, weights: dict[str, Tensor], engine_config) -> model
