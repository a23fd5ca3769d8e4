"""A ModelSpec from plain data (`ModelSpec.to_dict()`, as a packed store's manifest keeps it), each
sub-config read back as its layer kind's Config; also the flat form stores were written in before
ModelSpec held sub-configs (`kda_*`, `mla_*`, `index_*`, `gdn_*`, `hc_*`, `attn_res_block_size`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from localmoe.config import SUB_CONFIGS, ModelSpec
from localmoe.engine.layers import (
    attn_res,
    dsa,
    gated_deltanet,
    hyper_connections,
    kda,
    mla,
    vision_moonvit,
    vision_qwen3vl,
)


def spec_from_dict(data: dict[str, Any]) -> ModelSpec:
    """A ModelSpec from `ModelSpec.to_dict()` (a packed store's manifest), each sub-config as its kind's Config;
    a manifest written before the sub-configs (flat `kda_*`, `mla_*`, `index_*` ... fields) reads the same.
    Keys that are no fields (from a newer manifest) are ignored; a missing field raises KeyError / TypeError."""
    names = {f.name for f in dataclasses.fields(ModelSpec)}
    common = {k: v for k, v in data.items() if k in names and k not in SUB_CONFIGS}
    if common.get("vision") is not None:
        common["vision"] = _vision(common["vision"])
    if not any(k in data for k in SUB_CONFIGS):
        return ModelSpec(**common, **_flat_sub_configs(data))
    return ModelSpec(**common, **{k: None if data.get(k) is None else _config(CONFIG_TYPES[k], data[k])
                                  for k in SUB_CONFIGS})


CONFIG_TYPES = {"mla": mla.Config, "dsa": dsa.Config, "kda": kda.Config, "gated_delta": gated_deltanet.Config,
                "attn_res": attn_res.Config, "hyper_connections": hyper_connections.Config}  # by SUB_CONFIGS


def _vision(data: dict[str, Any]):
    """The image tower's Config (the Qwen3-VL one is the one with deep-stack layers); lists back to tuples."""
    cls = vision_qwen3vl.Config if "deepstack_visual_indexes" in data else vision_moonvit.Config
    return _config(cls, {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def _config(cls, data: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    if cls is dsa.Config:  # its MLA is a Config of its own
        data = {**data, "mla": _config(mla.Config, data["mla"])}
    return cls(**{k: v for k, v in data.items() if k in names})


def _flat_sub_configs(d: dict[str, Any]) -> dict[str, Any]:
    """The sub-configs of a spec as ModelSpec held them before: flat fields (stores written until then)."""
    kinds, D, L, eps = set(d.get("layer_kinds") or ()), d["hidden_size"], d["num_layers"], d.get("rms_norm_eps", 1e-6)
    out: dict[str, Any] = {}
    if kinds & {"mla", "dsa"}:
        nope = d.get("mla_use_nope", False)
        latent = mla.Config(d["num_heads"], d.get("q_lora_rank") or None, d["kv_lora_rank"], d["qk_nope_head_dim"],
                            d["qk_rope_head_dim"], d["v_head_dim"], d.get("mla_output_gate", False), nope,
                            d.get("mla_norm_eps", 1e-6), 1.0 if nope else mla.yarn_scale_factor(d.get("rope_scaling")), D)
        if "mla" in kinds:
            out["mla"] = latent
        if "dsa" in kinds:
            out["dsa"] = dsa.Config(latent, d["index_n_heads"], d["index_head_dim"], d["index_topk"],
                                    d.get("index_kpool", 0), d.get("index_kpool_tail", True))
    if "kda" in kinds:
        out["kda"] = kda.Config(d["kda_num_heads"], d["kda_head_dim"], d.get("kda_conv_kernel", 4),
                                d.get("kda_bounded_gate", False), d.get("kda_gate_lower_bound", -5.0),
                                d.get("kda_full_rank_gate", False), eps, D)
    if "gated_delta" in kinds:
        out["gated_delta"] = gated_deltanet.Config(d["gdn_num_key_heads"], d["gdn_num_value_heads"],
                                                   d["gdn_key_head_dim"], d["gdn_value_head_dim"],
                                                   d.get("gdn_conv_kernel", 4), eps, D)
    if d.get("attn_res_block_size"):
        out["attn_res"] = attn_res.Config(d["attn_res_block_size"], L, D, eps)
    if d.get("hc_mult"):
        out["hyper_connections"] = hyper_connections.Config(d["hc_mult"], L, D, d.get("hc_eps", 1e-6),
                                                            d.get("hc_sinkhorn_iters", 20), eps)
    return out
