"""What a model family declares: config parsers, tensor renaming rules, expected shapes.

A family is data plus a few small functions; the one loader (`localmoe/load.py`) applies
it. Canonical tensor names follow HF naming without the `model.` prefix, e.g.
`layers.3.self_attn.q_proj.weight`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from localmoe.config import ModelSpec
from localmoe.engine.transformer import Transformer, model_tensors

Transform = Callable[[torch.Tensor, ModelSpec], torch.Tensor]
PLACEHOLDERS = ("i", "e")  # layer index, expert id


@dataclass(frozen=True)
class TensorRule:
    """Checkpoint name pattern -> canonical name, optional transform. The pattern may hold
    `{i}` (layer index) and `{e}` (expert id); the target takes the same placeholders."""

    source: str
    target: str
    transform: Transform | None = None

    def compile(self) -> re.Pattern:
        pattern = re.escape(self.source)
        for key in PLACEHOLDERS:
            pattern = pattern.replace(re.escape("{" + key + "}"), rf"(?P<{key}>\d+)")
        return re.compile("^" + pattern + "$")


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
                target = rule.target
                for key, value in match.groupdict().items():
                    target = target.replace("{" + key + "}", value)
                return target, rule.transform
        if any(re.search(p, name) for p in self.ignore):
            return None
        raise KeyError(name)


def hf_rules(layer: tuple[str, ...], src: str = "model.") -> tuple[TensorRule, ...]:
    """An HF checkpoint's embedding, final norm and lm_head, and the `{src}layers.{i}.{name}` of `layer`
    kept under their names (`layers.{i}.{name}`)."""
    return (TensorRule(src + "embed_tokens.weight", "embed_tokens.weight"), TensorRule(src + "norm.weight", "norm.weight"),
            TensorRule("lm_head.weight", "lm_head.weight"),
            *(TensorRule(f"{src}layers.{{i}}.{name}", f"layers.{{i}}.{name}") for name in layer))


# An MTP / next-n layer's own tensors (DeepSeek-V3, GLM-4.5: `model.layers.{num_hidden_layers + k}.*`, engine/nextn.py);
# its decoder layer's tensors go through the family's own map. Its `embed_tokens` is a copy of the model's: not read.
NEXTN_TENSORS = TensorMap(
    rules=tuple(TensorRule(f"model.layers.{{i}}.{n}.weight", f"layers.{{i}}.{n}.weight")
                for n in ("eh_proj", "enorm", "hnorm", "shared_head.norm", "shared_head.head")),
    ignore=(r"^model\.layers\.\d+\.embed_tokens\.weight$",),
)
# the same in llama.cpp's GGUF layout: `blk.{L}.nextn.*`
NEXTN_GGUF = TensorMap(
    rules=tuple(TensorRule(f"blk.{{i}}.nextn.{g}.weight", f"layers.{{i}}.{n}.weight")
                for g, n in (("eh_proj", "eh_proj"), ("enorm", "enorm"), ("hnorm", "hnorm"),
                             ("shared_head_norm", "shared_head.norm"), ("shared_head_head", "shared_head.head"))),
    ignore=(r"^blk\.\d+\.nextn\.embed_tokens\.weight$",),
)


def build_transformer(spec: ModelSpec, weights: dict, engine_config, experts=None):
    """The `build` of every family whose layers the shared Transformer assembles from its kinds;
    `experts`: an ExpertProvider when `weights` holds no routed experts (packed stores)."""
    return Transformer(spec, weights, engine_config, experts)


EXPERT_FORMATS = ("bf16", "bf16_fused", "compressed_tensors_mxfp4", "gpt_oss_mxfp4", "ggml_mxfp4", "ggml")


@dataclass(frozen=True)
class ExpertTensors:
    """Where a family's routed experts live in its HF checkpoint (what `convert` packs).

    `patterns` maps a projection ("gate", "up", "down"; gpt-oss: "gate_up" with gate and
    up rows interleaved) to a checkpoint name with `{i}` (layer) and, unless `stacked`,
    `{e}` (expert). What the name denotes depends on `format`:
    - "bf16": the weight itself, e.g. `...experts.{e}.gate_proj.weight` [I, D]
    - "bf16_fused": stacked "gate_up" [E, D, 2I] (gate columns, then up) and "down" [E, I, D] as Qwen3-VL-MoE
      releases them, or transposed ([E, 2I, D], [E, D, I]) as transformers saves them; told apart by shape
    - "compressed_tensors_mxfp4": a stem; `{stem}.weight_packed` U8 [out, in/2] and
      `{stem}.weight_scale` U8 [out, in/32] (Kimi K3)
    - "gpt_oss_mxfp4": a stem of stacked tensors; `{stem}_blocks` U8 [E, out, in/32, 16],
      `{stem}_scales` U8 [E, out, in/32] and `{stem}_bias` [E, out]
    - "ggml_mxfp4" (GGUF): a stem of stacked tensors; `{stem}.weight` ggml `block_mxfp4` bytes
      U8 [E, out, in/32 * 17] and `{stem}.bias` F32 [E, out] (llama.cpp's gpt-oss)
    - "ggml" (GGUF): a stem; `{stem}.weight` [E, out, in] of any ggml type, block types as their raw
      bytes [E, out, row bytes] (llama.cpp's qwen3moe, deepseek2, ...)
    With `stacked`, dim 0 of each tensor indexes the expert.
    """

    format: str
    patterns: dict[str, str]
    stacked: bool = False

    def __post_init__(self) -> None:
        assert self.format in EXPERT_FORMATS, self.format

    def tensor_names(self, layer: int, expert: int, projection: str) -> list[str]:
        """Checkpoint tensors holding one projection of one expert (stacked: of all experts)."""
        stem = self.patterns[projection].replace("{i}", str(layer)).replace("{e}", str(expert))
        if self.format == "compressed_tensors_mxfp4":
            return [f"{stem}.weight_packed", f"{stem}.weight_scale"]
        if self.format == "gpt_oss_mxfp4":
            return [f"{stem}_blocks", f"{stem}_scales", f"{stem}_bias"]
        if self.format == "ggml_mxfp4":
            return [f"{stem}.weight", f"{stem}.bias"]
        if self.format == "ggml":
            return [f"{stem}.weight"]
        return [stem]

    def matcher(self) -> re.Pattern:
        """A regex matching every routed-expert tensor name of the checkpoint."""
        suffix = {"bf16": "", "bf16_fused": "", "compressed_tensors_mxfp4": r"\.weight_(?:packed|scale)",
                  "gpt_oss_mxfp4": r"_(?:blocks|scales|bias)", "ggml_mxfp4": r"\.(?:weight|bias)",
                  "ggml": r"\.weight"}[self.format]
        stems = [re.escape(p).replace(r"\{i\}", r"\d+").replace(r"\{e\}", r"\d+") for p in self.patterns.values()]
        return re.compile("^(?:" + "|".join(stems) + ")" + suffix + "$")


def gguf_float(value) -> float:
    """A GGUF float32 metadata value as the decimal it was written from: the shortest decimal that
    rounds to the same float32 (1e-5 is stored as 9.99999974e-06; the HF config said 1e-5)."""
    import numpy as np

    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


@dataclass(frozen=True)
class ModelFamily:
    """One model family: how to read its configs and tensors, and how to build it."""

    name: str
    model_types: tuple[str, ...]  # HF config.json `model_type` values
    spec_from_hf: Callable[[dict], ModelSpec]
    gguf_architectures: tuple[str, ...] = ()  # GGUF `general.architecture` values
    spec_from_gguf: Callable[[dict, set], ModelSpec] | None = None  # (metadata, tensor names)
    hf_tensors: TensorMap | None = None  # None: the engine cannot run this family yet
    gguf_tensors: Callable[[str], TensorMap] | None = None  # by GGUF architecture (permutations differ)
    # (canonical weights, spec) -> canonical weights, after renaming a GGUF's tensors and before the
    # shape checks: for tensors a GGUF splits or stores otherwise (gpt-oss's MXFP4 gate / up experts)
    gguf_finish: Callable[[dict, ModelSpec], dict] | None = None
    # canonical name -> shape of every tensor the spec asks for; default: composed from the layer kinds
    expected_shapes: Callable[[ModelSpec], dict[str, tuple[int, ...]]] = model_tensors
    # canonical-name regexes that may be present without the config asking for them (a tied lm_head)
    optional_tensors: tuple[str, ...] = (r"^lm_head\.weight$",)
    build: Callable | None = build_transformer  # (spec, weights: dict[str, Tensor], engine_config, experts=None)
    experts: ExpertTensors | None = None  # routed experts in the HF checkpoint (MoE families)
    gguf_experts: ExpertTensors | None = None  # routed experts in the family's GGUF files

    @property
    def runnable(self) -> bool:
        return self.build is not None
