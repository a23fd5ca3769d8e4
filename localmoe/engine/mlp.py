"""Dense gated MLP (SwiGLU) with gate and up projections fused into one matrix."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localmoe.engine.linear import Linear, make_linear

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedMLP:
    """down( act(gate x) * up x ); gate_up holds [gate; up] rows: [2I, hidden]."""

    def __init__(self, gate_up: Linear, down: Linear, activation: str = "silu"):
        self.gate_up, self.down = gate_up, down
        self.act = ACTIVATIONS[activation]
        self.intermediate = gate_up.out_features // 2

    @classmethod
    def from_weights(cls, spec, weights: dict[str, torch.Tensor], prefix: str, dtype: str,
                     stem: str = "mlp.") -> GatedMLP:
        """From canonical `{prefix}{stem}{gate,up,down}_proj.weight` (stem "mlp." by default)."""
        p = prefix + stem
        gate_up = make_linear([weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"]], None, dtype)
        return cls(gate_up, make_linear([weights[p + "down_proj.weight"]], None, dtype), spec.hidden_act)

    def nbytes(self) -> int:
        return self.gate_up.nbytes() + self.down.nbytes()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(self.act(gate) * up)
