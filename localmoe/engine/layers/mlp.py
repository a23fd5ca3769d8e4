"""Dense gated MLP (SwiGLU, GeGLU, K3's SiTU-GLU, GLM-5-Next's clamped SwiGLU) with gate and up
projections fused into one matrix."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

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


def glu_for(spec, name: str | None = None) -> GLU:
    """The (gate, up) -> hidden function of activation `name` (default `spec.hidden_act`), clamped
    at `spec.glu_limit` when that is set."""
    name = name or spec.hidden_act
    if name == "situ":
        return functools.partial(situ_glu, beta=spec.situ_beta, linear_beta=spec.situ_linear_beta)
    act = ACTIVATIONS[name]
    if spec.glu_limit:
        return functools.partial(clamped_glu, act=act, limit=spec.glu_limit)
    return lambda gate, up: act(gate) * up


class GatedMLP:
    """down( act(gate x) * up x ); gate_up holds [gate; up] rows: [2I, hidden]."""

    def __init__(self, gate_up: Linear, down: Linear, glu: GLU):
        self.gate_up, self.down, self.glu = gate_up, down, glu
        self.intermediate = gate_up.out_features // 2

    @classmethod
    def from_weights(cls, spec, weights: dict[str, torch.Tensor], prefix: str, dtype: str,
                     stem: str = "mlp.") -> GatedMLP:
        """From canonical `{prefix}{stem}{gate,up,down}_proj.weight` (stem "mlp." by default)."""
        p = prefix + stem
        gate_up = make_linear([weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"]], None, dtype)
        return cls(gate_up, make_linear([weights[p + "down_proj.weight"]], None, dtype), glu_for(spec))

    def nbytes(self) -> int:
        return self.gate_up.nbytes() + self.down.nbytes()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(self.glu(gate, up))


def gated_mlp_shapes(m: str, width: int, inner: int) -> dict[str, tuple[int, ...]]:
    """A gated MLP's `{m}{gate,up,down}_proj.weight` shapes: `width` in and out, `inner` between."""
    return {m + "gate_proj.weight": (inner, width), m + "up_proj.weight": (inner, width),
            m + "down_proj.weight": (width, inner)}
