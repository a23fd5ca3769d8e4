"""The Qwen3-VL vision encoder (Qwen3-VL, Qwen3-VL-MoE) with its patch merger and deep-stack mergers.

Patches arrive in spatial-merge-block order (each `spatial_merge_size`^2 block's patches together, as
the Qwen image processor emits them), each [C, temporal_patch_size, p, p] flattened (an image fills both
temporal slots). A linear map (the checkpoint's Conv3d, stride = kernel) embeds them; a learned square
position table is resampled bilinearly (align_corners) to the patch grid and added; pre-LayerNorm blocks
with fused qkv, axial 2D rotary (h then w frequencies, over the whole head dim) and a GELU-tanh MLP run
over each image. The merger LayerNorms each patch, concatenates a block and maps it through
Linear -> GELU -> Linear to the text width; after the blocks listed in `deepstack_visual_indexes`,
a deep-stack merger (LayerNorm over the concatenated block) makes one more feature set each, which
the text model adds to the image tokens' hidden states after its first layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localmoe.engine.layers import on_device
from localmoe.engine.layers.vit import ViT, rotate_half


@dataclass(frozen=True, slots=True)
class Config:
    """A Qwen3-VL vision encoder, from an HF `vision_config` (`Config.from_hf`)."""

    hidden_size: int = 1152  # D
    intermediate_size: int = 4304
    num_heads: int = 16
    depth: int = 27
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584  # the text model's width
    num_position_embeddings: int = 2304  # a square table: 48 x 48
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merged_dim(self) -> int:
        return self.hidden_size * self.spatial_merge_size ** 2

    @property
    def grid_side(self) -> int:
        return int(self.num_position_embeddings ** 0.5)

    @classmethod
    def from_hf(cls, vision: dict) -> Config:
        """From an HF `vision_config` dict (transformers' `Qwen3VLMoeVisionConfig` field names)."""
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters.rope_type {rope.get('rope_type')!r}: "
                             "the Qwen3-VL encoder has axial 2D rotary only")
        if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act {vision['hidden_act']!r}: Qwen3-VL uses gelu_pytorch_tanh")
        d = cls()
        n_pos = vision.get("num_position_embeddings", d.num_position_embeddings)
        if int(n_pos ** 0.5) ** 2 != n_pos:
            raise ValueError(f"vision_config.num_position_embeddings {n_pos} is not a square grid")
        return cls(hidden_size=vision.get("hidden_size", d.hidden_size),
                   intermediate_size=vision.get("intermediate_size", d.intermediate_size),
                   num_heads=vision.get("num_heads", vision.get("num_attention_heads", d.num_heads)),
                   depth=vision.get("depth", vision.get("num_hidden_layers", d.depth)),
                   in_channels=vision.get("in_channels", d.in_channels),
                   patch_size=vision.get("patch_size", d.patch_size),
                   temporal_patch_size=vision.get("temporal_patch_size", d.temporal_patch_size),
                   spatial_merge_size=vision.get("spatial_merge_size", d.spatial_merge_size),
                   out_hidden_size=vision.get("out_hidden_size", d.out_hidden_size),
                   num_position_embeddings=n_pos,
                   deepstack_visual_indexes=tuple(vision.get("deepstack_visual_indexes",
                                                             d.deepstack_visual_indexes)),
                   rope_theta=float(rope.get("rope_theta", d.rope_theta)))


def _merger_tensors(cfg: Config, m: str, postshuffle: bool) -> dict[str, tuple[int, ...]]:
    M, norm = cfg.merged_dim, (cfg.merged_dim if postshuffle else cfg.hidden_size)
    return {m + "norm.weight": (norm,), m + "norm.bias": (norm,), m + "linear_fc1.weight": (M, M),
            m + "linear_fc1.bias": (M,), m + "linear_fc2.weight": (cfg.out_hidden_size, M),
            m + "linear_fc2.bias": (cfg.out_hidden_size,)}


def tensors(cfg: Config, prefix: str = "visual.") -> dict[str, tuple[int, ...]]:
    """The encoder's tensors under `prefix` (HF names)."""
    D, inner, p, t = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size, cfg.temporal_patch_size
    out = {prefix + "patch_embed.proj.weight": (D, cfg.in_channels, t, p, p), prefix + "patch_embed.proj.bias": (D,),
           prefix + "pos_embed.weight": (cfg.num_position_embeddings, D)}
    for i in range(cfg.depth):
        b = f"{prefix}blocks.{i}."
        for norm in ("norm1", "norm2"):
            out[b + norm + ".weight"] = out[b + norm + ".bias"] = (D,)
        out[b + "attn.qkv.weight"], out[b + "attn.qkv.bias"] = (3 * D, D), (3 * D,)
        out[b + "attn.proj.weight"], out[b + "attn.proj.bias"] = (D, D), (D,)
        out[b + "mlp.linear_fc1.weight"], out[b + "mlp.linear_fc1.bias"] = (inner, D), (inner,)
        out[b + "mlp.linear_fc2.weight"], out[b + "mlp.linear_fc2.bias"] = (D, inner), (D,)
    out |= _merger_tensors(cfg, prefix + "merger.", postshuffle=False)
    for j in range(len(cfg.deepstack_visual_indexes)):
        out |= _merger_tensors(cfg, f"{prefix}deepstack_merger_list.{j}.", postshuffle=True)
    return out


def name_patterns(prefix: str = "visual.") -> list[str]:
    """Every tensor name of the encoder with `{i}` for the block or deep-stack merger index (a family's TensorRules)."""
    names = tensors(Config(depth=1, deepstack_visual_indexes=(0,)), prefix)
    return [n.replace(".blocks.0.", ".blocks.{i}.").replace(".deepstack_merger_list.0.", ".deepstack_merger_list.{i}.")
            for n in names]


class Qwen3VLVision(ViT):
    """`__call__(patches, grids)` -> per image (embeddings [tokens, out], [deep-stack features [tokens, out], ...])."""

    def _block_order(self, h: int, w: int) -> torch.Tensor:
        """Raster index of each patch in merge-block order."""
        m = self.cfg.spatial_merge_size
        return torch.arange(h * w, device=self.device).view(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()

    def _pos_embed(self, h: int, w: int, order: torch.Tensor) -> torch.Tensor:
        side = self.cfg.grid_side
        table = self._p("pos_embed.weight").view(side, side, -1).permute(2, 0, 1)[None]
        grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
        return grid.permute(1, 2, 0).reshape(h * w, -1)[order]

    def _rotary(self, h: int, w: int, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hs, ws = self._grid(h, w)
        hs, ws = hs[order], ws[order]
        f = torch.cat([hs[:, None].float() * self.inv_freq, ws[:, None].float() * self.inv_freq], dim=-1)
        f = torch.cat([f, f], dim=-1)  # [N, head_dim]
        return f.cos(), f.sin()

    def _merge(self, m: str, x: torch.Tensor, postshuffle: bool) -> torch.Tensor:
        cfg, M = self.cfg, self.cfg.merged_dim
        nw, nb = self._p(m + "norm.weight"), self._p(m + "norm.bias")
        x = F.layer_norm(x.reshape(-1, M), (M,), nw, nb, 1e-6) if postshuffle else \
            F.layer_norm(x, (cfg.hidden_size,), nw, nb, 1e-6).reshape(-1, M)
        x = F.gelu(F.linear(x, self._p(m + "linear_fc1.weight"), self._p(m + "linear_fc1.bias")))
        return F.linear(x, self._p(m + "linear_fc2.weight"), self._p(m + "linear_fc2.bias"))

    def encode(self, patches: torch.Tensor, grid: tuple[int, int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One image: patches [h * w, patch_dim] in merge-block order -> (embeddings, deep-stack features)."""
        cfg = self.cfg
        h, w = grid
        m = cfg.spatial_merge_size
        if patches.shape != (h * w, cfg.patch_dim):
            raise ValueError(f"image patches {tuple(patches.shape)} do not match its grid {h}x{w} "
                             f"of {cfg.patch_dim}-value patches")
        if h % m or w % m:
            raise ValueError(f"image grid {h}x{w} is not a multiple of the merge size {m}")
        order = self._block_order(h, w)
        proj = self._p("patch_embed.proj.weight")
        x = F.linear(patches.to(self.device, torch.float32), proj.reshape(proj.shape[0], -1), self._p("patch_embed.proj.bias"))
        x = x + self._pos_embed(h, w, order)
        cos, sin = self._rotary(h, w, order)
        c, s = cos[:, None], sin[:, None]
        names = ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.linear_fc1", "mlp.linear_fc2")
        deep = []
        for i in range(cfg.depth):
            x = self._block(f"blocks.{i}.", names, 1e-6, x, lambda t: t * c + rotate_half(t) * s)
            if i in cfg.deepstack_visual_indexes:
                j = cfg.deepstack_visual_indexes.index(i)
                deep.append(self._merge(f"deepstack_merger_list.{j}.", x, postshuffle=True))
        return self._merge("merger.", x, postshuffle=False), deep

    image = encode  # per image: (embeddings [tokens, out_hidden], deep-stack features [tokens, out_hidden] each)


def build(cfg: Config, weights: dict[str, torch.Tensor], prefix: str = "visual.", device: str = "cpu") -> Qwen3VLVision:
    """From the loader's checked weights (`tensors(cfg, prefix)`), in fp32 on `device`."""
    return Qwen3VLVision(cfg, {n: on_device(weights[n], device).float() for n in tensors(cfg, prefix)}, prefix, device)
