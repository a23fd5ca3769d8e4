"""`add_mtp_layer(path)`: append a random MTP layer to a generated DeepSeek-V3 / V3.2 checkpoint, as DeepSeek
releases it: `model.layers.{num_hidden_layers}.*` = a decoder layer shaped like the last one (its MoE
included, new random values), `eh_proj` [D, 2D], `enorm`, `hnorm`, `shared_head.norm`, and copies of the
model's `embed_tokens` and `lm_head` (`embed_tokens`, `shared_head.head`); config.json gets
`num_nextn_predict_layers` 1. (The generated GLM-4.5 checkpoints carry their MTP layer already.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def add_mtp_layer(path: str | Path, seed: int = 1) -> Path:
    from safetensors.torch import load_file, save_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    file = path / "model.safetensors"
    tensors = load_file(file)
    last, mtp = f"model.layers.{config['num_hidden_layers'] - 1}.", f"model.layers.{config['num_hidden_layers']}."
    gen = torch.Generator().manual_seed(seed)

    def like(t: torch.Tensor, name: str) -> torch.Tensor:
        if t.dim() == 1 and "norm" in name:  # norm weights near 1 (a LayerNorm bias near 0)
            base = 0.0 if name.endswith(".bias") else 1.0
            return (base + 0.02 * torch.randn(t.shape, generator=gen)).to(t.dtype)
        return (0.02 * torch.randn(t.shape, generator=gen)).to(t.dtype)

    new = {mtp + n[len(last):]: like(t, n) for n, t in tensors.items() if n.startswith(last)}
    D = tensors["model.norm.weight"].shape[0]
    dtype = tensors["model.norm.weight"].dtype
    new |= {mtp + "eh_proj.weight": (0.02 * torch.randn(D, 2 * D, generator=gen)).to(dtype),
            **{mtp + f"{n}.weight": (1 + 0.02 * torch.randn(D, generator=gen)).to(dtype)
               for n in ("enorm", "hnorm", "shared_head.norm")},
            mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
            mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone()}
    save_file(tensors | new, str(file), metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
