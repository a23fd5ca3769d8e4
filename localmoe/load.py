"""The one loader: a path (GGUF file, HF directory, or nothing = the embedded default)
becomes a ready model, its tokenizer and chat formatting.

Every family goes through the same steps: parse the config into a ModelSpec, rename each
checkpoint tensor through the family's TensorMap, assert its shape, build the model.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from localmoe.checkpoint import Checkpoint, open_checkpoint
from localmoe.config import EngineConfig, ModelSpec
from localmoe.engine.quantized import BlockQuantized, keeps_blocks, repack_blocks
from localmoe.engine.transformer import head_inputs
from localmoe.errors import CheckpointError, LocalMoEError, UnsupportedModelError
from localmoe.models.base import ModelFamily, TensorMap
from localmoe.weights import Weights, convert


def _progress(items: list, description: str, enabled: bool):
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=description, unit="tensor", file=sys.stderr, leave=False,
                disable=not sys.stderr.isatty())


ROUTED_EXPERTS = re.compile(r"^layers\.\d+\.mlp\.experts\.")  # canonical names a packed store keeps apart


def _canonical_weights(names: Sequence[str], read, tensor_map: TensorMap, family: ModelFamily, spec: ModelSpec,
                       source: str, progress: bool, elsewhere: re.Pattern | None = None,
                       finish=None) -> dict[str, torch.Tensor]:
    """Read, rename, transform and shape-check every tensor; fail naming the tensor at fault.

    Expected tensors matching `elsewhere` (a store's routed experts) are not required here;
    `finish(weights, spec)` (ModelFamily.gguf_finish) reshapes the renamed set before the checks."""
    weights = Weights()
    for name in _progress(list(names), f"loading {Path(source).name}", progress):
        try:
            resolved = tensor_map.resolve(name)
        except KeyError:
            raise CheckpointError(f"{source}: tensor {name!r} is not part of a {family.name}-family checkpoint "
                                  f"(model type {spec.model_type}); the file may be of another architecture")
        if resolved is None:
            continue
        canonical, transform = resolved
        tensor = read(name)
        if isinstance(tensor, BlockQuantized):  # kept in its blocks; transforms only reorder rows
            if transform is not None:
                tensor = tensor.map_rows(lambda rows, t=transform: t(rows, spec))
        else:
            tensor = convert(tensor, transform, spec)  # large floats: to fp32 when the builder takes them
        weights[canonical] = tensor
    if finish is not None:
        weights = Weights(finish(weights, spec))
    expected = _expert_forms(family.expected_shapes(spec), weights)
    for canonical, shape in expected.items():
        if canonical not in weights and elsewhere is not None and elsewhere.search(canonical):
            continue
        if canonical not in weights:
            raise CheckpointError(f"{source}: tensor {canonical!r} is missing (required by {spec.model_type} "
                                  f"with {spec.num_layers} layers)")
        if weights.shape(canonical) != shape:
            raise CheckpointError(f"{source}: tensor {canonical!r} has shape {weights.shape(canonical)}, "
                                  f"expected {shape} from the model config")
    optional = [re.compile(p) for p in family.optional_tensors]
    for canonical in weights.keys() - expected.keys():
        if not any(p.search(canonical) for p in optional):
            raise CheckpointError(f"{source}: tensor {canonical!r} is not used by this configuration "
                                  f"(model type {spec.model_type}); the config and weights disagree")
    return weights


_EXPERT_MATRIX = re.compile(r"\.mlp\.experts\.\d+\.(?:gate|up|down)\.(weight|packed|scales)$")


def _expert_forms(expected: dict[str, tuple[int, ...]], weights) -> dict[str, tuple[int, ...]]:
    """`expected` with each routed expert matrix in the form `weights` hold it. A family's shapes name one
    form, `P.weight` [out, in] (floats or ggml blocks) or MXFP4 `P.packed` [out, in/2] + `P.scales`
    [out, in/32]; a GGUF may hold the other (llama-quantize's MXFP4_MOE; a K3 whose experts a community
    quant requantised to Q4_K, IQ2_XXS, ...). Both run (engine/experts.py)."""
    out = dict(expected)
    for name, shape in expected.items():
        m = _EXPERT_MATRIX.search(name)
        if m is None or name in weights:
            continue
        stem = name[:m.start(1)]
        if m.group(1) == "weight" and stem + "packed" in weights:
            del out[name]
            out[stem + "packed"], out[stem + "scales"] = (shape[0], shape[1] // 2), (shape[0], shape[1] // 32)
        elif m.group(1) == "packed" and stem + "weight" in weights:
            del out[name]
            out[stem + "weight"] = (shape[0], shape[1] * 2)
        elif m.group(1) == "scales" and stem + "weight" in weights:
            del out[name]
    return out


def build_from_tensors(family: ModelFamily, spec: ModelSpec, tensors: dict[str, torch.Tensor], tensor_map: TensorMap,
                       config: EngineConfig, source: str = "<tensors>"):
    """Build a model from checkpoint-named tensors already in memory (tests, conversions)."""
    weights = _canonical_weights(list(tensors), tensors.__getitem__, tensor_map, family, spec, source, False)
    return family.build(spec, weights, config)


def _ggml_tensor(raw: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, ...], keep: bool, where: str):
    """One GGUF tensor from its stored bytes: matrices of a block type with a decode GEMV
    (kernels/ggml_gemv.TYPES) stay in their blocks when `keep` (--dtype auto); stacked MXFP4 experts
    stay bytes (ggml blocks, for ModelFamily.gguf_finish), stacked experts of other block types a 3-D
    BlockQuantized (split per expert by gguf_finish, computed from their blocks); F32 / F16 / BF16 come as
    zero-copy views, everything else dequantised to fp32.
    `where` ("file: tensor 'name'") starts any error."""
    from localmoe.quant.ggml import FLOAT_TYPES, SUPPORTED_TYPES, dequantize

    if keep and len(shape) == 2 and keeps_blocks(ggml_type):
        return BlockQuantized(raw, ggml_type, shape)
    if ggml_type == GGMLQuantizationType.MXFP4 and len(shape) == 3:
        return raw
    if len(shape) == 3 and ggml_type not in FLOAT_TYPES:
        # stacked experts of a block type stay in their blocks: each expert is computed from them
        if ggml_type not in SUPPORTED_TYPES:
            raise CheckpointError(f"{where}: ggml type {ggml_type.name} is not supported for experts; supported: "
                                  f"{', '.join(t.name for t in SUPPORTED_TYPES)}")
        return BlockQuantized(raw, ggml_type, shape)
    try:  # F16 / BF16 as zero-copy views: converted to fp32 when the builder takes them (localmoe.weights)
        return dequantize(raw, ggml_type, shape, FLOAT_TYPES.get(ggml_type, torch.float32))
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None


def _read_weights(ckpt: Checkpoint, config: EngineConfig, progress: bool):
    """(weights, experts) of an opened checkpoint: every tensor renamed, transformed and shape-checked;
    a packed store's routed experts stay in the store, served by the provider `localmoe.paging` builds."""
    from localmoe.paging import provider_for_store

    path, family, spec = ckpt.path, ckpt.family, ckpt.spec
    if ckpt.kind == "store" and not ckpt.config:  # converted from a GGUF
        if ckpt.gguf_metadata is None or ckpt.reader.file("gguf_tensors") is None or family.gguf_tensors is None \
                or not family.runnable:
            raise UnsupportedModelError(f"{path}: stores converted from {spec.model_type} GGUF files cannot be run "
                                        f"yet; run the GGUF file itself")
        if spec.moe_layers() and family.gguf_experts is None:
            raise UnsupportedModelError(f"{path}: this store keeps {spec.model_type}'s GGUF experts as dense "
                                        f"tensors; run the GGUF file itself")
    ckpt.require_runnable()
    if ckpt.kind == "config":
        raise CheckpointError(f"{path} holds no .safetensors files, only the model config; give the directory "
                              f"with the weights (localmoe inspect reads a config alone)")
    read = ckpt.reader.tensor if ckpt.kind == "hf" else _ggml_reader(ckpt, config.dtype == "auto")
    finish = family.gguf_finish if ckpt.gguf_metadata is not None else None
    store = ckpt.kind == "store"
    weights = _canonical_weights(ckpt.tensor_names, read, ckpt.tensor_map, family, spec, str(path), progress,
                                 elsewhere=ROUTED_EXPERTS if store else None, finish=finish)
    if ckpt.kind != "hf" and config.dtype == "auto" and config.device == "cpu":
        # the blocks kept resident, for the row kernels (same bits); the lm_head's where it reads int8 or int16 inputs
        inputs = head_inputs(spec, config)
        weights = repack_blocks(weights, int8_head=inputs == "int8", x16_head=inputs == "int16")
    experts = provider_for_store(ckpt.reader, spec, config) if store and spec.moe_layers() else None
    return weights, experts


def _ggml_reader(ckpt: Checkpoint, keep: bool):
    """read(name) for a GGUF file, or a store's dense tensors: typed ones as stored, a GGUF store's raw
    blocks (U8, typed by its gguf-tensors.json) as the GGUF file's."""
    path = ckpt.path
    if ckpt.kind == "gguf":
        gguf = ckpt.reader

        def read(name: str):
            info = gguf.info(name)
            return _ggml_tensor(gguf.raw(name), info.ggml_type, info.shape, keep, f"{path}: tensor {name!r}")

        return read
    store = ckpt.reader
    types = json.loads(store.file("gguf_tensors").read_text())["tensors"] if ckpt.gguf_metadata is not None else {}

    def read_dense(name: str):
        tensor, info = store.dense(name), types.get(name)
        if info is None or tensor.dtype != torch.uint8 or info["ggml_type"] in ("I8", "I16", "I32", "I64"):
            return tensor
        return _ggml_tensor(tensor, GGMLQuantizationType(info["ggml_type_id"]), tuple(info["shape"]), keep,
                            f"{path}: tensor {name!r}")

    return read_dense


@dataclass
class LoadedModel:
    """A model ready to generate: spec, engine model, tokenizer, and where it came from."""

    spec: ModelSpec
    model: object
    tokenizer: object
    source: Path
    config: EngineConfig

    @functools.cached_property
    def chat_format(self):
        """The family's ChatFormat (K3 XTML, gpt-oss harmony, else the Jinja template): localmoe.chat."""
        from localmoe.chat import chat_format_for

        return chat_format_for(self.spec, self.tokenizer)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    reasoning_effort: str | None = None) -> list[int]:
        """Token ids of an OpenAI-style conversation rendered in the model's chat format."""
        from localmoe.chat import messages_from_openai

        return self.chat_format.render(messages_from_openai(messages), tools=tools, reasoning_effort=reasoning_effort,
                                       add_generation_prompt=add_generation_prompt)

    @functools.cached_property
    def image_encoder(self):
        """The model's ImageEncoder (engine/images.py): images encoded once per content hash, preprocessed with the
        checkpoint's `preprocessor_config.json` where it has one (a packed store keeps a copy)."""
        from localmoe.engine.images import ImageEncoder

        settings = Path(self.source) / "preprocessor_config.json" if self.source is not None else None
        if settings is None or not settings.is_file():
            return ImageEncoder(self.model)
        try:
            config = json.loads(settings.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{settings}: not readable JSON ({e}); fix or remove the file") from None
        return ImageEncoder(self.model, processor_config=config)


def load_model(path: str | Path | None = None, config: EngineConfig | None = None, progress: bool = True,
               **options) -> LoadedModel:
    """Load a GGUF file, an HF safetensors directory or a packed store (None = the embedded default model)."""
    config = config or EngineConfig(**options)
    torch.set_num_threads(config.resolved_threads())
    ckpt = open_checkpoint(path)
    path, family, spec = ckpt.path, ckpt.family, ckpt.spec
    weights, experts = _read_weights(ckpt, config, progress)
    tokenizer = ckpt.tokenizer()
    if experts is None and config.paging.gpu_budget:
        raise LocalMoEError(f"{path}: --gpu-mem holds routed experts of a packed store, and this model is not one "
                            f"with experts; convert it (localmoe convert) or leave --gpu-mem at 0")
    model = family.build(spec, weights, config, experts)
    if experts is not None:
        from localmoe.paging import attach_provider

        attach_provider(model, experts, config)
    return LoadedModel(spec=spec, model=model, tokenizer=tokenizer, source=path, config=config)


def _with_layer(spec: ModelSpec, kinds: tuple[str, str]) -> ModelSpec:
    """`spec` with one more layer of `kinds` (mixer, MLP) appended: a GGUF finish's view of the MTP layer."""
    import dataclasses

    return dataclasses.replace(spec, num_layers=spec.num_layers + 1, layer_kinds=spec.layer_kinds + (kinds[0],),
                               mlp_kinds=spec.mlp_kinds + (kinds[1],))


def load_nextn(loaded: LoadedModel, index: int = 0):
    """MTP / next-n layer `index` of `loaded`'s checkpoint (engine/nextn.py `NextN`, on the model): read only
    when asked for (`--spec mtp`), every tensor renamed and shape-checked like the model's. From a packed store
    that holds the layer's routed experts as extents (layer num_layers + index, as `convert` writes them), they
    come through the model's own expert provider (the pager: its budget, policy and reads, the layer's requests
    told to it as any layer's), not into memory."""
    from localmoe.engine import nextn
    from localmoe.models.base import NEXTN_GGUF, NEXTN_TENSORS

    spec = loaded.spec
    paged = False  # the layer's routed experts are extents of the store
    if index >= spec.nextn_layers:
        raise LocalMoEError(f"{loaded.source}: the checkpoint declares {spec.nextn_layers} multi-token-prediction "
                            f"layer(s) (num_nextn_predict_layers), not {index + 1}")
    ckpt = open_checkpoint(loaded.source)
    try:
        layer = spec.num_layers + index
        gguf = ckpt.gguf_metadata is not None
        if gguf and ckpt.family.gguf_finish is None or ckpt.kind == "store" and gguf:
            raise UnsupportedModelError(f"{ckpt.path}: localmoe does not read the MTP block (blk.{layer}.nextn.*) "
                                        f"of this {'store' if ckpt.kind == 'store' else 'GGUF file'} yet; use the "
                                        "GGUF file or the HF checkpoint")
        names = ckpt.nextn_tensor_names(index)
        if not names:
            raise CheckpointError(f"{ckpt.path}: declares {spec.nextn_layers} MTP layer(s) but holds no tensor of "
                                  f"layer {layer}" + (" (a store converted before localmoe kept them: convert the "
                                                      "checkpoint again)" if ckpt.kind == "store" else ""))
        read = ckpt.reader.tensor if ckpt.kind == "hf" else _ggml_reader(ckpt, False)
        own = NEXTN_GGUF if gguf else NEXTN_TENSORS
        paged = ckpt.kind == "store" and layer in ckpt.reader.layers()
        weights = Weights()
        for name in names:
            try:
                resolved = own.resolve(name)
            except KeyError:
                try:
                    resolved = ckpt.tensor_map.resolve(name)
                except KeyError:
                    raise CheckpointError(f"{ckpt.path}: tensor {name!r} is not part of a {ckpt.family.name} MTP "
                                          f"layer") from None
            if resolved is not None:
                weights[resolved[0]] = convert(read(name), resolved[1], spec)
        if gguf:  # the family's finish (stacked experts split, MLA's k_b / v_b joined) over the MTP layer too
            weights = Weights(ckpt.family.gguf_finish(weights, _with_layer(spec, nextn.kinds(spec))))
    finally:
        ckpt.close()
    expected = nextn.tensors(spec, index)
    if paged:
        expected = {name: shape for name, shape in expected.items() if not ROUTED_EXPERTS.search(name)}
    head = f"layers.{layer}.{nextn.OWN_HEAD}"
    for canonical in weights.keys() - expected.keys() - {head}:
        raise CheckpointError(f"{ckpt.path}: tensor {canonical!r} is not used by an MTP layer of {spec.model_type}")
    for canonical, shape in (expected | ({head: (spec.vocab_size, spec.hidden_size)} if head in weights else {})).items():
        if canonical not in weights:
            raise CheckpointError(f"{ckpt.path}: tensor {canonical!r} of the MTP layer is missing")
        if weights.shape(canonical) != shape:
            raise CheckpointError(f"{ckpt.path}: tensor {canonical!r} has shape {weights.shape(canonical)}, "
                                  f"expected {shape} from the model config")
    if not paged:
        return nextn.NextN(loaded.model, weights, index)
    provider = loaded.model.moe_blocks()[0].experts  # the store's (loaded from the same store)
    head = nextn.NextN(loaded.model, weights, index, experts=provider)
    _page_hints(head, loaded.model, provider, layer)
    return head


def _page_hints(head, model, provider, layer: int) -> None:
    """Where the model's routers tell its pager their choices (paging.hooks.attach), the MTP layer's does too:
    its experts' loads start together, and the policy sees the layer as any other (no lookahead guesses: its
    input depends on the token it is given)."""
    from localmoe.paging.hooks import PagedRouter

    router = model.moe_blocks()[0].router
    if isinstance(router, PagedRouter) and router.pager is provider and hasattr(head.mlp, "router"):
        head.mlp.router = PagedRouter(head.mlp.router, layer, provider)
