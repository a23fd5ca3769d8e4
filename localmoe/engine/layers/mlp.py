"""Dense gated MLP (SwiGLU, GeGLU, K3's SiTU-GLU, GLM-5-Next's clamped SwiGLU) with gate and up
projections fused into one matrix."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localmoe.engine.layers import on_device
from localmoe.engine.linear import Linear, make_linear

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "situ": None}  # situ is a whole GLU, not act(gate) * up: see situ_glu

GLU = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) [N, I] -> [N, I]


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """Kimi K3 SiTU-GLU: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)."""
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (linear_beta * torch.tanh(up / linear_beta))


def clamped_glu(gate: torch.Tensor, up: torch.Tensor, act, limit: float) -> torch.Tensor:
    """GLM-5-Next: act(min(gate, limit)) * clamp(up, -limit, limit) (`swiglu_limit`)."""
    return act(gate.clamp(max=limit)) * up.clamp(-limit, limit)


@dataclass(frozen=True, slots=True)
class Config:
    """A dense gated MLP (also a MoE layer's shared experts), from the model's common fields (`Config.of`)."""

    hidden_size: int  # D, in and out
    intermediate_size: int  # I, between
    hidden_act: str = "silu"  # ACTIVATIONS
    glu_limit: float = 0.0  # GLM-5-Next: gate and up clamped at this (`swiglu_limit`); 0 = no clamp
    situ_beta: float = 4.0  # K3 SiTU-GLU (hidden_act "situ")
    situ_linear_beta: float = 25.0

    @classmethod
    def of(cls, spec, intermediate_size: int | None = None) -> Config:
        """The dense MLP of a ModelSpec; `intermediate_size` for another width (shared experts)."""
        return cls(spec.hidden_size, spec.intermediate_size if intermediate_size is None else intermediate_size,
                   spec.hidden_act, spec.glu_limit, spec.situ_beta, spec.situ_linear_beta)


def glu_for(cfg: Config) -> GLU:
    """The (gate, up) -> hidden function of `cfg.hidden_act`, clamped at `cfg.glu_limit` when that is set."""
    if cfg.hidden_act == "situ":
        return functools.partial(situ_glu, beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta)
    act = ACTIVATIONS[cfg.hidden_act]
    if cfg.glu_limit:
        return functools.partial(clamped_glu, act=act, limit=cfg.glu_limit)
    return lambda gate, up: act(gate) * up


class GatedMLP:
    """down( act(gate x) * up x ); gate_up holds [gate; up] rows: [2I, hidden]."""

    def __init__(self, gate_up: Linear, down: Linear, glu: GLU):
        self.gate_up, self.down, self.glu = gate_up, down, glu
        self.intermediate = gate_up.out_features // 2

    def nbytes(self) -> int:
        return self.gate_up.nbytes() + self.down.nbytes()

    @property
    def independent_rows(self) -> int:
        """The most rows one call computes each on its own (both linears'; engine/batch.py)."""
        return min(self.gate_up.independent_rows, self.down.independent_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(self.glu(gate, up))


def tensors(cfg: Config, prefix: str, stem: str = "mlp.") -> dict[str, tuple[int, ...]]:
    """Layer `prefix`'s `{stem}{gate,up,down}_proj.weight` (a MoE layer's shared experts: stem
    "mlp.shared_experts.")."""
    D, inner, m = cfg.hidden_size, cfg.intermediate_size, prefix + stem
    return {m + "gate_proj.weight": (inner, D), m + "up_proj.weight": (inner, D), m + "down_proj.weight": (D, inner)}


def build(cfg: Config, weights: dict[str, torch.Tensor], prefix: str, device: str = "cpu", dtype: str = "auto",
          stem: str = "mlp.") -> GatedMLP:
    """From canonical `{prefix}{stem}{gate,up,down}_proj.weight` (shapes checked on load), on `device`."""
    def w(name: str) -> torch.Tensor:
        return on_device(weights[prefix + stem + name + "_proj.weight"], device)

    gate_up = make_linear([w("gate"), w("up")], None, dtype)
    return GatedMLP(gate_up, make_linear([w("down")], None, dtype), glu_for(cfg))
