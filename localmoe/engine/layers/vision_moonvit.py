"""The Kimi MoonViT vision tower (Kimi-VL, Kimi K2.5, Kimi K3) and its multimodal projector.

Patches of `patch_size` pixels are embedded by a linear map (the checkpoint's Conv2d with stride =
kernel), a learned [pos_emb_height, pos_emb_width, D] grid is resampled bicubically to each image's
patch grid and added, and encoder layers (pre-LayerNorm, bidirectional attention with axial 2D rotary
over the whole head dim, GELU-tanh MLP) run over each image separately. After the final LayerNorm each
`merge_kernel` block of patches becomes one token: the projector LayerNorms each patch, concatenates
the block (kh * kw * D) and maps it through Linear -> GELU -> Linear to the text model's width.
The result replaces the image's placeholder tokens in the text embedding, one row per merged token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localmoe.engine.layers import on_device
from localmoe.engine.layers.vit import ViT


@dataclass(frozen=True, slots=True)
class Config:
    """A MoonViT tower + projector, from an HF `vision_config` (`Config.from_hf`)."""

    hidden_size: int = 1152  # D
    intermediate_size: int = 4304
    num_heads: int = 16
    num_layers: int = 27
    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    merge_kernel: tuple[int, int] = (2, 2)
    rope_theta: float = 10000.0
    text_hidden_size: int = 7168  # the projector's output width
    projection_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merged_dim(self) -> int:
        return self.hidden_size * self.merge_kernel[0] * self.merge_kernel[1]

    @classmethod
    def from_hf(cls, vision: dict, text_hidden_size: int, projection_eps: float = 1e-5) -> Config:
        """From an HF `vision_config` dict: transformers' `Kimi_K25VisionConfig` field names, or the
        remote-code names of the released configs (`vt_*`, `init_pos_emb_*`; unverified against a K3 config)."""
        aliases = {"vt_hidden_size": "hidden_size", "vt_intermediate_size": "intermediate_size",
                   "vt_num_attention_heads": "num_attention_heads", "vt_num_hidden_layers": "num_hidden_layers",
                   "init_pos_emb_height": "pos_emb_height", "init_pos_emb_width": "pos_emb_width"}
        vision = {**{aliases[k]: v for k, v in vision.items() if k in aliases}, **vision}
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters.rope_type {rope.get('rope_type')!r}: "
                             "the MoonViT tower has axial 2D rotary only")
        if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act {vision['hidden_act']!r}: MoonViT uses gelu_pytorch_tanh")
        d = cls()
        return cls(hidden_size=vision.get("hidden_size", d.hidden_size),
                   intermediate_size=vision.get("intermediate_size", d.intermediate_size),
                   num_heads=vision.get("num_attention_heads", d.num_heads),
                   num_layers=vision.get("num_hidden_layers", d.num_layers),
                   patch_size=vision.get("patch_size", d.patch_size),
                   pos_emb_height=vision.get("pos_emb_height", d.pos_emb_height),
                   pos_emb_width=vision.get("pos_emb_width", d.pos_emb_width),
                   merge_kernel=tuple(vision.get("merge_kernel_size", d.merge_kernel)),
                   rope_theta=float(rope.get("rope_theta", d.rope_theta)),
                   text_hidden_size=text_hidden_size, projection_eps=projection_eps)


def tensors(cfg: Config, prefix: str = "vision_tower.", projector: str = "mm_projector.") -> dict[str, tuple[int, ...]]:
    """The tower's tensors under `prefix` and the projector's under `projector`, in the released checkpoints'
    layout (Kimi-VL, K2.5, K3): fused `wqkv` whose q and k rows pair each rotary dimension with the next
    (interleaved, as a complex number), `norm0` / `norm1`, `mlp.fc0` / `mlp.fc1`, projector `proj.0` / `proj.2`."""
    D, inner, p, M = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size, cfg.merged_dim
    out = {prefix + "patch_embed.proj.weight": (D, 3, p, p), prefix + "patch_embed.proj.bias": (D,),
           prefix + "patch_embed.pos_emb.weight": (cfg.pos_emb_height, cfg.pos_emb_width, D)}
    for i in range(cfg.num_layers):
        b = f"{prefix}encoder.blocks.{i}."
        for norm in ("norm0", "norm1"):
            out[b + norm + ".weight"] = out[b + norm + ".bias"] = (D,)
        out[b + "wqkv.weight"], out[b + "wqkv.bias"] = (3 * D, D), (3 * D,)
        out[b + "wo.weight"], out[b + "wo.bias"] = (D, D), (D,)
        out[b + "mlp.fc0.weight"], out[b + "mlp.fc0.bias"] = (inner, D), (inner,)
        out[b + "mlp.fc1.weight"], out[b + "mlp.fc1.bias"] = (D, inner), (D,)
    out[prefix + "encoder.final_layernorm.weight"] = out[prefix + "encoder.final_layernorm.bias"] = (D,)
    out[projector + "pre_norm.weight"] = out[projector + "pre_norm.bias"] = (D,)
    out[projector + "proj.0.weight"], out[projector + "proj.0.bias"] = (M, M), (M,)
    out[projector + "proj.2.weight"], out[projector + "proj.2.bias"] = (cfg.text_hidden_size, M), \
        (cfg.text_hidden_size,)
    return out


def name_patterns(prefix: str = "vision_tower.", projector: str = "mm_projector.") -> list[str]:
    """Every tensor name of the tower and projector with `{i}` for the block index (a family's TensorRules)."""
    names = tensors(Config(num_layers=1), prefix, projector)
    return [n.replace(".blocks.0.", ".blocks.{i}.") for n in names]


def rotate_pairs(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary: x [N, H, hd] with dims (2r, 2r+1) a complex number turned by angles [N, hd/2]."""
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)[:, None]).flatten(-2)


class MoonViT(ViT):
    """The tower and projector: `__call__(patches, grids)` -> one [tokens, text_hidden] tensor per image."""

    def __init__(self, cfg: Config, w: dict[str, torch.Tensor], prefix: str, projector: str, device="cpu"):
        super().__init__(cfg, w, prefix, device)
        self.projector = projector

    def _pos_embed(self, h: int, w: int) -> torch.Tensor:
        """The learned grid resampled to h x w patches (bicubic, half-pixel centres): [h * w, D]."""
        table = self._p("patch_embed.pos_emb.weight")
        if table.shape[:2] == (h, w):
            return table.reshape(h * w, -1)
        grid = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bicubic", align_corners=False)
        return grid[0].permute(1, 2, 0).reshape(h * w, -1)

    def _rotary(self, h: int, w: int) -> torch.Tensor:
        """Angles [h * w, head_dim / 2] of the raster patch grid, one per rotary pair: w0, h0, w1, h1, ..."""
        hs, ws = self._grid(h, w)
        fh = hs[:, None].float() * self.inv_freq  # [N, hd/4]
        fw = ws[:, None].float() * self.inv_freq
        return torch.stack([fw, fh], dim=-1).flatten(1)

    def encode(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """One image's tower output before the projector: patches [h * w, 3, p, p] in raster order ->
        [h * w / (kh * kw), kh * kw, D], each merge block's patches together (row-major in the block)."""
        cfg = self.cfg
        h, w = grid
        kh, kw = cfg.merge_kernel
        if patches.shape != (h * w, 3, cfg.patch_size, cfg.patch_size):
            raise ValueError(f"image patches {tuple(patches.shape)} do not match its grid {h}x{w} "
                             f"of {cfg.patch_size}-pixel patches")
        if h % kh or w % kw:
            raise ValueError(f"image grid {h}x{w} is not a multiple of the merge kernel {kh}x{kw}")
        proj = self._p("patch_embed.proj.weight")
        x = F.linear(patches.to(self.device, torch.float32).reshape(h * w, -1), proj.reshape(proj.shape[0], -1),
                     self._p("patch_embed.proj.bias"))
        x = x + self._pos_embed(h, w)
        angles = self._rotary(h, w)
        names = ("norm0", "wqkv", "wo", "norm1", "mlp.fc0", "mlp.fc1")
        for i in range(cfg.num_layers):
            x = self._block(f"encoder.blocks.{i}.", names, 1e-5, x, lambda t: rotate_pairs(t, angles))
        D = cfg.hidden_size
        x = F.layer_norm(x, (D,), self._p("encoder.final_layernorm.weight"), self._p("encoder.final_layernorm.bias"),
                         1e-5)
        x = x.view(h // kh, kh, w // kw, kw, D).permute(0, 2, 1, 3, 4)
        return x.reshape(-1, kh * kw, D)

    def project(self, merged: torch.Tensor) -> torch.Tensor:
        """The multimodal projector: [T, kh * kw, D] -> [T, text_hidden]."""
        P, cfg = self.projector, self.cfg
        x = F.layer_norm(merged, (cfg.hidden_size,), self.w[P + "pre_norm.weight"], self.w[P + "pre_norm.bias"],
                         cfg.projection_eps).reshape(merged.shape[0], -1)
        x = F.gelu(F.linear(x, self.w[P + "proj.0.weight"], self.w[P + "proj.0.bias"]))
        return F.linear(x, self.w[P + "proj.2.weight"], self.w[P + "proj.2.bias"])

    def image(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """One image's patches [h * w, 3, p, p] -> its tokens [tokens, text_hidden]."""
        return self.project(self.encode(patches, grid))


def build(cfg: Config, weights: dict[str, torch.Tensor], prefix: str = "vision_tower.",
          projector: str = "mm_projector.", device: str = "cpu") -> MoonViT:
    """From the loader's checked weights (`tensors(cfg, prefix, projector)`), in fp32 on `device`."""
    names = tensors(cfg, prefix, projector)
    return MoonViT(cfg, {n: on_device(weights[n], device).float() for n in names}, prefix, projector, device)
