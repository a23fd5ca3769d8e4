"""What a checkpoint is, read from metadata and headers only (no weights are loaded).

Used by `localmoe inspect` and later by the server's /v1/models and the UIs' info panels.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from localmoe.config import EngineConfig, ModelSpec
from localmoe.errors import CheckpointError, LocalMoEError
from localmoe.models import family_for_gguf, family_for_model_type


def _parameters(name: str, shape) -> int:
    """Parameters a stored tensor holds: a packed MXFP4 byte holds two, its scales none.
    Checkpoint names (`weight_packed`, `_blocks`) and store part names (`.packed`) alike."""
    if name.endswith(("weight_scale", "_scales", ".scales")):
        return 0
    count = math.prod(shape)
    return 2 * count if name.endswith(("weight_packed", "_blocks", ".packed")) else count


def _from_gguf(path: Path) -> tuple[ModelSpec, dict, dict, dict | None]:
    from localmoe.store.gguf import GGUFFile

    gguf = GGUFFile(path)
    family = family_for_gguf(gguf.architecture, str(path))
    names = gguf.tensor_names()
    spec = family.spec_from_gguf(gguf.metadata, set(names))
    counts, nbytes = Counter(), Counter()
    for name in names:
        info = gguf.info(name)
        kind = info.ggml_type.name
        counts[kind] += 1
        nbytes[kind] += info.nbytes
    return spec, dict(counts), dict(nbytes), None


def _from_store(path: Path) -> tuple[ModelSpec, dict, dict, dict | None]:
    from localmoe.store.packed import PackedStore

    store = PackedStore(path)
    spec = store.spec
    counts, nbytes = Counter(), Counter()
    dense_params = routed = 0
    for name in store.dense_names():
        tensor = store.dense(name)
        kind = str(tensor.dtype).removeprefix("torch.")
        counts[kind] += 1
        nbytes[kind] += tensor.nbytes
        dense_params += tensor.numel()
    for layer in store.layers():
        layout, experts = store.layout(layer), len(store.experts_in(layer))
        for part in layout.parts:
            kind = str(part.dtype).removeprefix("torch.")
            counts[kind] += experts
            nbytes[kind] += experts * part.nbytes
            routed += experts * _parameters(part.name, part.shape)
    if not spec.num_experts:  # dense (e.g. from a GGUF, whose blocks are stored as bytes): count from the spec
        return spec, dict(counts), dict(nbytes), None
    share = spec.num_experts_per_tok / spec.num_experts
    return spec, dict(counts), dict(nbytes), {"total": dense_params + routed,
                                              "active": dense_params + round(routed * share)}


def _from_hf(path: Path) -> tuple[ModelSpec, dict, dict, dict | None]:
    from localmoe.store.safetensors import SafetensorsCheckpoint

    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_path}: cannot read the model config ({e})") from None
    family = family_for_model_type(config.get("model_type", "<missing>"), str(config_path))
    spec = family.spec_from_hf(config)
    checkpoint = SafetensorsCheckpoint(path)
    counts, nbytes = Counter(), Counter()
    expert = family.experts.matcher() if family.experts else None
    routed = other = 0
    for name in checkpoint.keys():
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


def describe_model(path: str | Path, config: EngineConfig | None = None) -> dict:
    """A JSON-able description: architecture, layer kinds, parameters, dtypes, memory estimate."""
    config = config or EngineConfig()
    path = Path(path)
    if not path.exists():
        raise LocalMoEError(f"{path}: no such file or directory")
    if (path / "manifest.json").is_file():
        spec, counts, nbytes, counted = _from_store(path)
    else:
        spec, counts, nbytes, counted = _from_hf(path) if path.is_dir() else _from_gguf(path)
    params = counted or spec.parameter_counts()
    context = config.context_for(spec)
    kv_per_token = spec.kv_bytes_per_token(4) if spec.sizes_cache() else None
    layer_kinds = Counter(zip(spec.layer_kinds, spec.mlp_kinds))
    return {
        "path": str(path),
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
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "parameters_total": params["total"],
        "parameters_active": params["active"],
        "tensor_dtypes": {kind: {"tensors": counts[kind], "bytes": nbytes[kind]} for kind in counts},
        "memory": {
            "file_bytes": sum(nbytes.values()),
            "weights_fp32_bytes": params["total"] * 4,
            "weights_bf16_bytes": params["total"] * 2,
            "kv_cache_bytes_per_token": kv_per_token,
            "context": context,
            "kv_cache_bytes_at_context": kv_per_token * context if kv_per_token is not None else None,
        },
    }


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


def format_description(d: dict) -> str:
    """Human-readable text for `localmoe inspect`."""
    m = d["memory"]
    lines = [
        f"model          {d['name'] or Path(d['path']).name}",
        f"architecture   {d['model_type']} (family {d['family']})",
        f"layers         {d['layers']}: " + ", ".join(f"{n} x {k}" for k, n in d["layer_kinds"].items()),
        f"dimensions     hidden {d['hidden_size']}, heads {d['heads']} (kv {d['kv_heads']}) x {d['head_dim']}, "
        f"mlp {d['intermediate_size']}, vocab {d['vocab_size']}",
        *([f"experts        {d['experts']['routed']} routed ({d['experts']['per_token']} per token) + "
           f"{d['experts']['shared']} shared, in {d['experts']['moe_layers']} MoE layers"]
          if d["experts"]["routed"] else []),
        f"context        {d['max_position_embeddings']} tokens (model max)",
        f"parameters     {_count(d['parameters_total'])} total, {_count(d['parameters_active'])} active per token"
        + (" (embedding tied to lm_head)" if d["tie_word_embeddings"] else ""),
        "tensor dtypes  " + ", ".join(f"{k}: {v['tensors']} tensors, {_size(v['bytes'])}"
                                      for k, v in sorted(d["tensor_dtypes"].items())),
        f"memory         file {_size(m['file_bytes'])}; weights in RAM {_size(m['weights_fp32_bytes'])} fp32 / "
        f"{_size(m['weights_bf16_bytes'])} bf16",
        f"kv cache       {_size(m['kv_cache_bytes_per_token'])} per token (fp32); "
        f"{_size(m['kv_cache_bytes_at_context'])} at {m['context']} tokens"
        if m["kv_cache_bytes_per_token"] is not None else
        "kv cache       not estimated yet for DSA layers",
    ]
    return "\n".join(lines)
