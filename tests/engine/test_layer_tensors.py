"""The contract of every layer kind (engine/layers/<kind>.py): `tensors(cfg, prefix)` names exactly the
weights `build(cfg, weights, prefix)` reads, at the shapes the loader checks them against, so `build` needs
no shape checks of its own and a family's expected shapes are the kinds' (transformer.model_tensors)."""

from __future__ import annotations

import pytest
import torch

from localmoe.engine.layers import attention, attn_res, dsa, gated_deltanet, hyper_connections, kda, mla, mlp, moe
from localmoe.engine.layers.moe import ExpertGLU, RoutingRule

D, P = 32, "layers.2."
LATENT = mla.Config(4, None, 16, 8, 4, 8, hidden_size=D)
Q_LORA = mla.Config(4, 12, 16, 8, 4, 8, output_gate=True, hidden_size=D)
DENSE = mlp.Config(D, 48)
RULE = RoutingRule(top_k=2, scoring="sigmoid", renormalize=True)
KINDS = {  # id -> (module, config, prefix)
    "gqa": (attention, attention.Config(D, 4, 2, 8, bias=True, qk_norm=True), P),
    "gqa-gated": (attention, attention.Config(D, 4, 2, 8, output_gate=True, partial_rotary_factor=0.25), P),
    "gqa-sinks-window": (attention, attention.Config(D, 4, 2, 8, bias=True, sinks=True, window=4), P),
    "mla": (mla, LATENT, P),
    "mla-q-lora-gate": (mla, Q_LORA, P),
    "dsa": (dsa, dsa.Config(Q_LORA, 2, 8, 4), P),
    "dsa-kpool": (dsa, dsa.Config(Q_LORA, 2, 8, 4, index_kpool=2), P),
    "kda-kimi-linear": (kda, kda.Config(4, 8, 4, hidden_size=D), P),
    "kda-k3": (kda, kda.Config(4, 8, 4, bounded_gate=True, full_rank_gate=True, hidden_size=D), P),
    "gated-deltanet": (gated_deltanet, gated_deltanet.Config(2, 4, 8, 8, hidden_size=D), P),
    "mlp": (mlp, DENSE, P),
    "moe-shared": (moe, moe.Config(D, 4, 16, RULE, ExpertGLU("swiglu"), mlp.Config(D, 32), correction_bias=True), P),
    "moe-latent": (moe, moe.Config(D, 4, 16, RULE, ExpertGLU("situ", 4.0, 25.0), DENSE, correction_bias=True,
                                   latent_size=16), P),
    "moe-gated-shared": (moe, moe.Config(D, 4, 16, RoutingRule(top_k=2), ExpertGLU("swiglu"), mlp.Config(D, 24),
                                         shared_gate=True), P),
    "attn-res": (attn_res, attn_res.Config(3, 3, D), ""),
    "hyper-connections": (hyper_connections, hyper_connections.Config(2, 3, D), ""),
}


class Reads(dict):
    """The weights, recording every name read."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)

    def get(self, name, default=None):
        self.read.add(name)
        return super().get(name, default)

    def __contains__(self, name):
        self.read.add(name)
        return super().__contains__(name)


@pytest.mark.parametrize("kind", list(KINDS))
def test_tensors_are_what_build_reads(kind):
    module, cfg, prefix = KINDS[kind]
    shapes = module.tensors(cfg, prefix)
    gen = torch.Generator().manual_seed(0)
    weights = Reads({name: torch.rand(shape, generator=gen) + 0.5 for name, shape in shapes.items()})
    layer = module.build(cfg, weights, prefix)
    assert set(shapes) <= weights.read, f"tensors() names weights build does not read: {set(shapes) - weights.read}"
    assert layer.nbytes() >= sum(4 * torch.Size(s).numel() for n, s in shapes.items() if "experts." not in n) // 2
