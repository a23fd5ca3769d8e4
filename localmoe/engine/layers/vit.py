"""What the vision towers (vision_moonvit, vision_qwen3vl) share: weights by name on one device, axial
rotary frequencies, the pre-LayerNorm encoder block (fused qkv, bidirectional attention, GELU-tanh MLP)
and the loop that encodes concatenated images one at a time. Each tower supplies its names, rotary
style and per-image `encode`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Half-split rotary's partner: [x1, x2] -> [-x2, x1] over the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ViT:
    """A tower's weights `w` (names under `prefix`, fp32 on `device`) and the per-image loop."""

    def __init__(self, cfg, w: dict[str, torch.Tensor], prefix: str, device="cpu"):
        self.cfg, self.w, self.prefix = cfg, w, prefix
        self.device = torch.device(device)  # where its weights are; images' patches go there
        hd = cfg.head_dim  # axial rotary: head_dim / 4 frequencies per axis
        self.inv_freq = (1.0 / (cfg.rope_theta ** (torch.arange(0, hd // 2, 2, dtype=torch.float32) / (hd // 2)))
                         ).to(self.device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.w.values())

    def _p(self, name: str) -> torch.Tensor:
        return self.w[self.prefix + name]

    def _grid(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column of each patch of an h x w grid, raster order: ([h * w], [h * w])."""
        hs, ws = torch.meshgrid(torch.arange(h, device=self.device), torch.arange(w, device=self.device), indexing="ij")
        return hs.flatten(), ws.flatten()

    def _block(self, ly: str, names: tuple[str, str, str, str, str, str], eps: float, x: torch.Tensor,
               rotate: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One pre-LayerNorm encoder block under prefix `ly`; `names`: its norm before attention, qkv,
        attention output, norm before the MLP, MLP in, MLP out; `rotate` applies the rotary to q or k [N, H, hd]."""
        cfg = self.cfg
        D, H, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        n_attn, qkv, out, n_mlp, fc_in, fc_out = names

        def lin(name, t):
            return F.linear(t, self._p(ly + name + ".weight"), self._p(ly + name + ".bias"))

        def norm(name, t):
            return F.layer_norm(t, (D,), self._p(ly + name + ".weight"), self._p(ly + name + ".bias"), eps)

        N = x.shape[0]
        q, k, v = lin(qkv, norm(n_attn, x)).view(N, 3, H, hd).unbind(1)
        q, k = rotate(q), rotate(k)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        x = x + lin(out, o.transpose(0, 1).reshape(N, D))
        return x + lin(fc_out, F.gelu(lin(fc_in, norm(n_mlp, x)), approximate="tanh"))

    def image(self, patches: torch.Tensor, grid: tuple[int, int]):
        """One image's output from its patches."""
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> list:
        """Images' patches concatenated along dim 0 (h * w rows each) with their grids -> per image `image(...)`."""
        out, start = [], 0
        for h, w in grids:
            out.append(self.image(patches[start:start + h * w], (h, w)))
            start += h * w
        if start != patches.shape[0]:
            raise ValueError(f"{patches.shape[0]} patches given for grids holding {start}")
        return out
