"""Config-reading helpers shared by the MoE families (1-indexed layer lists, MoE placement, the
DeepSeek-style config and expert layout that DeepSeek-V3.2 and GLM-5-Next share, the
Kimi-Linear-style text config that Kimi-Linear and Kimi K3 share)."""

from __future__ import annotations

from localmoe.config import ModelSpec
from localmoe.engine.layers import dsa, kda, mla
from localmoe.errors import CheckpointError
from localmoe.models.base import ExpertTensors


def require(config: dict, key: str, source: str = "config.json"):
    if key not in config:
        raise CheckpointError(f"{source}: field {key!r} is missing (model_type {config.get('model_type')!r})")
    return config[key]


def dims(config: dict, source: str = "config.json") -> dict:
    """The common ModelSpec dimensions of a config.json with a GQA-style head layout (`head_dim`, else
    hidden / heads) and `intermediate_size`."""
    heads = require(config, "num_attention_heads", source)
    return {"vocab_size": require(config, "vocab_size", source), "hidden_size": require(config, "hidden_size", source),
            "num_layers": require(config, "num_hidden_layers", source), "num_heads": heads,
            "num_kv_heads": config.get("num_key_value_heads") or heads,
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
            "intermediate_size": require(config, "intermediate_size", source)}


def kinds_from_one_indexed(num_layers: int, lists: dict[str, list[int]], source: str) -> tuple[str, ...]:
    """Per-layer kinds from 1-INDEXED layer lists (e.g. Kimi's `kda_layers` / `full_attn_layers`)."""
    kinds: list[str | None] = [None] * num_layers
    for kind, layers in lists.items():
        for layer in layers:
            if not 1 <= layer <= num_layers:
                raise CheckpointError(f"{source}: layer {layer} in the {kind} list is outside 1..{num_layers} "
                                      f"(these lists are 1-indexed)")
            if kinds[layer - 1] is not None:
                raise CheckpointError(f"{source}: layer {layer} is listed as both {kinds[layer - 1]} and {kind}")
            kinds[layer - 1] = kind
    missing = [i + 1 for i, k in enumerate(kinds) if k is None]
    if missing:
        raise CheckpointError(f"{source}: layers {missing} (1-indexed) are in no attention-kind list")
    return tuple(kinds)


def moe_placement(num_layers: int, first_dense: int, frequency: int = 1, kind: str = "moe") -> tuple[str, ...]:
    """DeepSeek-style placement: the first `first_dense` layers dense, then MoE every `frequency` layers."""
    return tuple(kind if i >= first_dense and (i - first_dense) % max(frequency, 1) == 0 else "dense"
                 for i in range(num_layers))


def dsa_fields(config: dict, source: str, indexer: bool = True) -> dict:
    """The ModelSpec fields of DSA layers (MLA + indexer; without the `indexer`: plain MLA layers) and DeepSeek
    routing from a (text) config dict."""
    layers = {"dsa": dsa.Config.from_hf(config, source)} if indexer else {"mla": mla.Config.from_hf(config)}
    return {**layers, "scoring_func": config.get("scoring_func", "sigmoid"),
            "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
            "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
            "n_group": int(config.get("n_group") or 1), "topk_group": int(config.get("topk_group") or 1)}


def indexer_types(text: dict, layers: int) -> list[str]:
    """"full" (runs its indexer) or "shared" per layer, as transformers derives them (GLM-5-Next, GLM-5)."""
    if text.get("indexer_types"):
        return list(text["indexer_types"])
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(text.get("index_topk_freq", 1), 1), text.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


def moe_spec(config: dict, model_type: str, layer_kinds, mlp_kinds, source: str, **fields) -> ModelSpec:
    """ModelSpec of a DeepSeek-style MoE config (`n_routed_experts`, `v_head_dim` ...); `fields` add the rest."""
    heads = require(config, "num_attention_heads", source)
    return ModelSpec(
        model_type=model_type, family=model_type,
        vocab_size=require(config, "vocab_size", source),
        hidden_size=require(config, "hidden_size", source),
        num_layers=require(config, "num_hidden_layers", source), num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=require(config, "v_head_dim", source),
        intermediate_size=require(config, "intermediate_size", source),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rope_scaling=config.get("rope_scaling"),
        max_position_embeddings=config.get("max_position_embeddings", 163840),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        layer_kinds=layer_kinds, mlp_kinds=mlp_kinds,
        num_experts=require(config, "n_routed_experts", source),
        num_experts_per_tok=require(config, "num_experts_per_tok", source),
        moe_intermediate_size=require(config, "moe_intermediate_size", source),
        num_shared_experts=config.get("n_shared_experts", 0),
        **fields,
    )


def experts(prefix: str) -> ExpertTensors:
    """DeepSeek-layout bf16 routed experts `{prefix}layers.{i}.mlp.experts.{e}.{gate,up,down}_proj`."""
    stem = prefix + "layers.{i}.mlp.experts.{e}"
    return ExpertTensors("bf16", {"gate": f"{stem}.gate_proj.weight", "up": f"{stem}.up_proj.weight",
                                  "down": f"{stem}.down_proj.weight"})


def kimi_text_spec(config: dict, model_type: str, family: str, source: str = "config.json") -> ModelSpec:
    """ModelSpec from a Kimi-Linear-style text config (also K3's `text_config`)."""
    layers = require(config, "num_hidden_layers", source)
    linear = require(config, "linear_attn_config", source)
    kinds = kinds_from_one_indexed(layers, {"kda": linear.get("kda_layers", []),
                                            "mla": linear.get("full_attn_layers", [])}, source)
    heads = require(config, "num_attention_heads", source)
    return ModelSpec(
        model_type=model_type, family=family,
        vocab_size=require(config, "vocab_size", source),
        hidden_size=require(config, "hidden_size", source),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("v_head_dim") or linear.get("head_dim"),
        intermediate_size=require(config, "intermediate_size", source),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        max_position_embeddings=config.get("model_max_length") or config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        hidden_act=config.get("hidden_act", "silu"),
        layer_kinds=kinds,
        mlp_kinds=moe_placement(layers, config.get("first_k_dense_replace", 0), config.get("moe_layer_freq", 1),
                                "latent_moe" if config.get("routed_expert_hidden_size") else "moe"),
        num_experts=require(config, "num_experts", source),
        num_experts_per_tok=require(config, "num_experts_per_token", source),
        moe_intermediate_size=require(config, "moe_intermediate_size", source),
        num_shared_experts=config.get("num_shared_experts", 0),
        latent_moe_size=config.get("routed_expert_hidden_size") or 0,
        kda=kda.Config.from_hf(config, family), mla=mla.Config.from_hf(config),
    )
