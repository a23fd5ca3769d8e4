"""Dense gated MLP (SwiGLU) with gate and up projections fused into one matrix."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localmoe.engine.linear import Linear

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedMLP:
    """down( act(gate x) * up x ); gate_up holds [gate; up] rows: [2I, hidden]."""

    def __init__(self, gate_up: Linear, down: Linear, activation: str = "silu"):
        self.gate_up, self.down = gate_up, down
        self.act = ACTIVATIONS[activation]
        self.intermediate = gate_up.out_features // 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(self.act(gate) * up)
