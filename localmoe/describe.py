"""What a checkpoint is, read from metadata and headers only (no weights are loaded).

Used by `localmoe inspect` and later by the server's /v1/models and the UIs' info panels.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from localmoe.checkpoint import Checkpoint, open_checkpoint
from localmoe.config import KV_CACHE_DTYPES, EngineConfig, ModelSpec


def _parameters(name: str, shape) -> int:
    """Parameters a stored tensor holds: a packed MXFP4 byte holds two, its scales none.
    Checkpoint names (`weight_packed`, `_blocks`) and store part names (`.packed`) alike."""
    if name.endswith(("weight_scale", "_scales", ".scales")):
        return 0
    count = math.prod(shape)
    return 2 * count if name.endswith(("weight_packed", "_blocks", ".packed")) else count


def _from_gguf(ckpt: Checkpoint) -> tuple[ModelSpec, dict, dict, dict | None, int]:
    """As the other sources, plus about how many bytes of weights `load_model(path)` holds with
    --dtype auto and the CPU kernel library: matrices of a block type with a GEMV
    (kernels/ggml_gemv.TYPES) and stacked experts of a block type stay as stored, the embedding of such a type
    too (a tied head shares it); other matrices become bf16 (what auto picks where bf16 GEMV is
    sound), vectors fp32."""
    from gguf import GGMLQuantizationType as Q

    from localmoe.kernels.ggml_gemv import TYPES

    gguf, spec = ckpt.reader, ckpt.spec
    counts, nbytes = Counter(), Counter()
    loaded = routed = other = 0
    for name in ckpt.tensor_names:
        info = gguf.info(name)
        kind = info.ggml_type.name
        counts[kind] += 1
        nbytes[kind] += info.nbytes
        if "_exps." in name:  # llama.cpp's stacked routed experts
            routed += math.prod(info.shape)
        else:
            other += math.prod(info.shape)
        stays = (len(info.shape) == 2 and info.ggml_type in TYPES) or (  # stacked experts of any block type
            len(info.shape) == 3 and info.ggml_type not in (Q.F32, Q.F16, Q.BF16))
        loaded += info.nbytes if stays else math.prod(info.shape) * (2 if len(info.shape) >= 2 else 4)
    counted = None
    if routed and spec.num_experts:  # a token uses k of E routed experts
        counted = {"total": other + routed, "active": other + round(routed * spec.num_experts_per_tok / spec.num_experts)}
    return spec, dict(counts), dict(nbytes), counted, loaded


def _from_store(ckpt: Checkpoint) -> tuple[ModelSpec, dict, dict, dict | None]:
    """As the other sources; a store converted from a GGUF names its ggml types (its dense blocks from
    gguf-tensors.json, its experts' blocks from the part suffix, `gate.q4_k`) and counts their values."""
    import json

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    store, spec = ckpt.reader, ckpt.spec
    ggml = store.file("gguf_tensors")
    ggml = json.loads(ggml.read_text())["tensors"] if ggml is not None else {}
    counts, nbytes = Counter(), Counter()
    dense_params = routed = 0
    for name in store.dense_names():
        tensor = store.dense(name)
        kind = str(tensor.dtype).removeprefix("torch.")
        if name in ggml:
            kind = ggml[name]["ggml_type"]
        counts[kind] += 1
        nbytes[kind] += tensor.nbytes
        dense_params += math.prod(ggml[name]["shape"]) if name in ggml else tensor.numel()
    for layer in store.layers():
        layout, experts = store.layout(layer), len(store.experts_in(layer))
        for part in layout.parts:
            kind, params = str(part.dtype).removeprefix("torch."), _parameters(part.name, part.shape)
            suffix = part.name.rsplit(".", 1)[-1].upper()
            if suffix in GGMLQuantizationType.__members__:  # a GGUF expert's blocks
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType[suffix]]
                kind, params = suffix, part.shape[0] * (part.shape[1] // size) * block
            counts[kind] += experts
            nbytes[kind] += experts * part.nbytes
            routed += experts * params
    if not spec.num_experts:  # dense (e.g. from a GGUF, whose blocks are stored as bytes): count from the spec
        return spec, dict(counts), dict(nbytes), None
    share = spec.num_experts_per_tok / spec.num_experts
    return spec, dict(counts), dict(nbytes), {"total": dense_params + routed,
                                              "active": dense_params + round(routed * share)}


def _from_config(family, spec: ModelSpec) -> tuple[ModelSpec, dict, dict, dict | None]:
    """No weights: parameters from the shapes the family expects (routed experts: `.experts.{e}.` names)."""
    routed = other = 0
    for name, shape in family.expected_shapes(spec).items():
        if ".experts." in name:
            routed += _parameters(name, shape)
        else:
            other += _parameters(name, shape)
    share = spec.num_experts_per_tok / spec.num_experts if spec.num_experts else 1.0
    return spec, {}, {}, {"total": other + routed, "active": other + round(routed * share)}


def _from_hf(ckpt: Checkpoint) -> tuple[ModelSpec, dict, dict, dict | None]:
    """An HF directory, or only its config (a directory holding just config.json, or a .json file)."""
    family, spec, checkpoint = ckpt.family, ckpt.spec, ckpt.reader
    if ckpt.kind == "config":
        return _from_config(family, spec)
    counts, nbytes = Counter(), Counter()
    expert = family.experts.matcher() if family.experts else None
    routed = other = 0
    for name in checkpoint.keys():  # noqa: SIM118 - SafetensorsCheckpoint has keys() but is not iterable
        dtype, shape, size, _offset = checkpoint.info(name)
        kind = str(dtype).removeprefix("torch.")
        counts[kind] += 1
        nbytes[kind] += size
        if expert is not None and expert.match(name):
            routed += _parameters(name, shape)
        else:
            other += _parameters(name, shape)
    if expert is not None:  # MoE: count from the tensors; a token uses k of E routed experts
        share = spec.num_experts_per_tok / spec.num_experts
        return spec, dict(counts), dict(nbytes), {"total": other + routed, "active": other + round(routed * share)}
    return spec, dict(counts), dict(nbytes), None


def describe_model(path: str | Path | None, config: EngineConfig | None = None) -> dict:
    """A JSON-able description: architecture, layer kinds, parameters, dtypes, memory estimate."""
    config = config or EngineConfig()
    ckpt = open_checkpoint(path)
    path = ckpt.path
    loaded = None  # a GGUF's bytes as loaded with its blocks kept
    if ckpt.kind == "store":
        spec, counts, nbytes, counted = _from_store(ckpt)
    elif ckpt.kind == "gguf":
        spec, counts, nbytes, counted, loaded = _from_gguf(ckpt)
    else:
        spec, counts, nbytes, counted = _from_hf(ckpt)
    params = counted or spec.parameter_counts()
    context = config.context_for(spec)
    state = delta_state_bytes(spec)
    cache = cache_sizes(spec, context, state or 0)
    kv_per_token = cache[config.kv_cache_dtype]["bytes_per_token"]
    layer_kinds = Counter(zip(spec.layer_kinds, spec.mlp_kinds))
    return {
        "path": str(path),
        **({"files": [str(p) for p in ckpt.reader.files]} if ckpt.kind == "gguf" else {}),  # a split GGUF's parts
        "name": spec.name,
        "model_type": spec.model_type,
        "family": spec.family,
        "layers": spec.num_layers,
        "layer_kinds": {f"{attn}+{mlp}": n for (attn, mlp), n in layer_kinds.items()},
        "hidden_size": spec.hidden_size,
        "heads": spec.num_heads,
        "kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "experts": {"routed": spec.num_experts, "per_token": spec.num_experts_per_tok,
                    "shared": spec.num_shared_experts, "moe_layers": len(spec.moe_layers())},
        "vocab_size": spec.vocab_size,
        "vision": _vision(spec),
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "parameters_total": params["total"],
        "parameters_active": params["active"],
        "tensor_dtypes": {kind: {"tensors": counts[kind], "bytes": nbytes[kind]} for kind in counts},
        "memory": {
            "file_bytes": sum(nbytes.values()),
            "weights_fp32_bytes": params["total"] * 4,
            "weights_bf16_bytes": params["total"] * 2,
            "weights_loaded_bytes": loaded,  # GGUF blocks kept as they are (--dtype auto); None for other sources
            "kv_cache_dtype": config.kv_cache_dtype,
            "kv_cache_bytes_per_token": kv_per_token,
            "context": context,
            "kv_cache_bytes_at_context": kv_per_token * context,
            "kv_cache": cache,  # per cache dtype
            "delta_state_bytes": state,
        },
    }


def _vision(spec: ModelSpec) -> dict | None:
    """The image tower's facts (None without one): kind, blocks, width, patch, deep-stack blocks, MRoPE."""
    v = spec.vision
    if v is None:
        return None
    qwen = hasattr(v, "deepstack_visual_indexes")
    return {"tower": "Qwen3-VL" if qwen else "MoonViT", "blocks": v.depth if qwen else v.num_layers,
            "hidden_size": v.hidden_size, "patch_size": v.patch_size, "image_token_id": spec.image_token_id,
            "deepstack_blocks": list(v.deepstack_visual_indexes) if qwen else [],
            "mrope_section": list(spec.mrope_section) if spec.mrope_section else None}


MILLION = 1 << 20  # "1M tokens": K3's context of 1,048,576


def cache_sizes(spec: ModelSpec, context: int, state: int = 0) -> dict:
    """Cache bytes of one sequence per KV cache dtype: per token, at `context` and at 1M tokens, and
    at 1M tokens with the constant delta-rule `state` added (engine/cache.py's layout: fp8 adds one
    fp32 scale per token and KV head, or per MLA row)."""
    sizes = {}
    for dtype in KV_CACHE_DTYPES:
        per_token = spec.kv_bytes_per_token(dtype)
        sizes[dtype] = {"bytes_per_token": per_token, "bytes_at_context": per_token * context,
                        "bytes_at_1m_tokens": per_token * MILLION, "total_at_1m_tokens": per_token * MILLION + state}
    return sizes


def delta_state_bytes(spec: ModelSpec, batch: int = 1) -> int | None:
    """Constant cache bytes of the delta-rule layers (fp32 state + conv tails, any context length);
    None where a kind's state is not sized yet (Gated DeltaNet)."""
    if "gated_delta" in spec.layer_kinds:
        return None
    kda = spec.layer_kinds.count("kda")
    if not kda:
        return 0
    from localmoe.engine.layers.kda import state_bytes

    return kda * state_bytes(spec.kda, batch)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def format_type_bytes(tensor_dtypes: dict) -> str:
    """`describe_model(...)["tensor_dtypes"]` as text: per dtype or ggml type, its tensors and bytes."""
    return ", ".join(f"{k}: {v['tensors']} tensors, {_size(v['bytes'])}" for k, v in sorted(tensor_dtypes.items()))


def format_description(d: dict) -> str:
    """Human-readable text for `localmoe inspect`."""
    m = d["memory"]
    lines = [
        f"model          {d['name'] or Path(d['path']).name}",
        f"architecture   {d['model_type']} (family {d['family']})",
        *([f"files          {len(d['files'])} parts: {Path(d['files'][0]).name} ... {Path(d['files'][-1]).name}"]
          if len(d.get("files", ())) > 1 else []),
        f"layers         {d['layers']}: " + ", ".join(f"{n} x {k}" for k, n in d["layer_kinds"].items()),
        (f"dimensions     hidden {d['hidden_size']}, heads {d['heads']} (kv {d['kv_heads']}) x {d['head_dim']}, "
         f"mlp {d['intermediate_size']}, vocab {d['vocab_size']}"),
        *([(f"experts        {d['experts']['routed']} routed ({d['experts']['per_token']} per token) + "
            f"{d['experts']['shared']} shared, in {d['experts']['moe_layers']} MoE layers")]
          if d["experts"]["routed"] else []),
        *([_vision_line(d["vision"])] if d.get("vision") else []),
        f"context        {d['max_position_embeddings']} tokens (model max)",
        f"parameters     {_count(d['parameters_total'])} total, {_count(d['parameters_active'])} active per token"
        + (" (embedding tied to lm_head)" if d["tie_word_embeddings"] else ""),
        "tensor dtypes  " + (format_type_bytes(d["tensor_dtypes"]) or "none (config only)"),
        (f"memory         file {_size(m['file_bytes']) if m['file_bytes'] else 'none (config only)'}; weights in RAM "
         + (f"~{_size(m['weights_loaded_bytes'])} with --dtype auto (blocks kept), "
            if m["weights_loaded_bytes"] is not None else "")
         + f"{_size(m['weights_fp32_bytes'])} fp32 / {_size(m['weights_bf16_bytes'])} bf16"),
        *_cache_lines(m),
    ]
    return "\n".join(lines)


def _vision_line(v: dict) -> str:
    deep = f", deep-stack after blocks {', '.join(map(str, v['deepstack_blocks']))}" if v["deepstack_blocks"] else ""
    mrope = f"; MRoPE {'/'.join(map(str, v['mrope_section']))}" if v["mrope_section"] else ""
    return (f"vision         {v['tower']} tower: {v['blocks']} blocks x {v['hidden_size']}, {v['patch_size']}-px patches"
            f"{deep}; image token {v['image_token_id']}{mrope}")


def _cache_lines(m: dict) -> list[str]:
    """One line per cache dtype (the chosen one marked) and the constant delta-rule state."""
    lines = []
    for i, (dtype, s) in enumerate(m["kv_cache"].items()):
        mark = " (selected)" if dtype == m["kv_cache_dtype"] else ""
        lines.append(f"{'kv cache' if i == 0 else '':<15}{dtype + mark + ':':<20} {_size(s['bytes_per_token'])} per "
                     f"token; {_size(s['bytes_at_context'])} at {m['context']} tokens; "
                     f"{_size(s['bytes_at_1m_tokens'])} at 1M tokens"
                     + (f" ({_size(s['total_at_1m_tokens'])} with the delta state)" if m["delta_state_bytes"]
                        else ""))
    state = m["delta_state_bytes"]
    if state is None:
        lines.append("delta state    not estimated yet for Gated DeltaNet layers")
    elif state:
        lines.append(f"delta state    {_size(state)} per sequence, constant in the context (fp32 state + conv tails)")
    return lines
