"""ToyDiT: a tiny DiT-style flow transformer for small gray latents (8x8 digits, 8x16 numbers).

Single-stream: text tokens and image patches share one sequence and one set
of block weights (joint self-attention), with adaLN-zero modulation from
timestep + pooled prompt. The forward signature mirrors diffusers' SD3
transformer so the engine can call the toy model and real ones alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ToyDiTConfig:
    """Shape of the toy transformer."""

    sample_size: int = 8
    """latent height (and width, unless `sample_width` is set)"""
    sample_width: int | None = None
    """latent width when the canvas is not square (None: square, `sample_size`)"""
    in_channels: int = 1
    patch_size: int = 2
    width: int = 64
    depth: int = 3
    heads: int = 4
    text_dim: int = 64
    mlp_ratio: int = 4
    pos_embed_std: float = 0.02
    """init scale of the patch position embeddings; larger tells patches apart from the first step
    (toy-numbers: which half a patch is in decides which digit it draws)"""


def timestep_embedding(timestep: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding [B, dim] of timesteps in diffusers units (0..1000), in fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=timestep.device, dtype=torch.float32) / half)
    args = timestep.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: per-sample shift/scale [B, D] applied to x [B, N, D]."""
    return x * (1 + scale[:, None]) + shift[:, None]


class ToyDiTBlock(nn.Module):
    """Pre-norm attention + MLP, each gated by adaLN-zero modulation from c."""

    def __init__(self, width: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width), nn.GELU(approximate="tanh"),
                                 nn.Linear(mlp_ratio * width, width))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(width, 6 * width))
        # adaLN-zero: each block starts as the identity, which keeps early training stable.
        nn.init.zeros_(self.ada[1].weight)
        nn.init.zeros_(self.ada[1].bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        b, n, _ = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).chunk(6, dim=-1)
        q, k, v = self.qkv(modulate(self.norm1(x), shift1, scale1)).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + gate1[:, None] * self.proj(attn.transpose(1, 2).reshape(b, n, -1))
        x = x + gate2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))
        return x


class ToyDiT(nn.Module):
    """Predicts the flow velocity v = eps - x0 of [B, C, H, W] latents given prompt embeddings."""

    def __init__(self, config: ToyDiTConfig):
        super().__init__()
        self.config = config
        w, p, c = config.width, config.patch_size, config.in_channels
        height = config.sample_size
        width = config.sample_size if config.sample_width is None else config.sample_width
        if height % p or width % p:
            raise ValueError(f"the latent {height}x{width} (sample_size x sample_width) is not a multiple of "
                             f"patch_size={p} on both sides")
        self.grid_h, self.grid_w = height // p, width // p  # patches per column and per row
        self.patch_embed = nn.Linear(c * p * p, w)
        self.pos_embed = nn.Parameter(torch.randn(self.grid_h * self.grid_w, w) * config.pos_embed_std)
        self.time_mlp = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
        self.pooled_proj = nn.Linear(config.text_dim, w)
        self.text_proj = nn.Linear(config.text_dim, w)
        self.blocks = nn.ModuleList(ToyDiTBlock(w, config.heads, config.mlp_ratio) for _ in range(config.depth))
        self.norm_out = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Sequential(nn.SiLU(), nn.Linear(w, 2 * w))
        self.proj_out = nn.Linear(w, c * p * p)
        nn.init.zeros_(self.ada_out[1].weight)
        nn.init.zeros_(self.ada_out[1].bias)

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, (H/p)*(W/p), C*p*p], row-major over patches."""
        b, c, _, _ = x.shape
        p, gh, gw = self.config.patch_size, self.grid_h, self.grid_w
        return x.view(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * p * p)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of patchify."""
        b = x.shape[0]
        p, gh, gw, c = self.config.patch_size, self.grid_h, self.grid_w, self.config.in_channels
        return x.view(b, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, gh * p, gw * p)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor,
                encoder_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Velocity [B, C, H, W] at `timestep` [B] (flow time t * 1000)."""
        dtype = self.patch_embed.weight.dtype
        b = hidden_states.shape[0]
        img = self.patch_embed(self.patchify(hidden_states.to(dtype))) + self.pos_embed
        txt = self.text_proj(encoder_hidden_states.to(dtype))
        n_txt = txt.shape[1]
        temb = self.time_mlp(timestep_embedding(timestep, self.config.width).to(dtype))
        c = temb + self.pooled_proj(pooled_projections.to(dtype))

        attn_mask = None
        if encoder_attention_mask is not None:
            # Padded text tokens are never attended to; image tokens always are.
            img_keys = torch.ones(b, img.shape[1], dtype=torch.bool, device=img.device)
            attn_mask = torch.cat([encoder_attention_mask.to(torch.bool), img_keys], dim=1)[:, None, None, :]

        x = torch.cat([txt, img], dim=1)
        for block in self.blocks:
            x = block(x, c, attn_mask)
        shift, scale = self.ada_out(c).chunk(2, dim=-1)
        out = self.proj_out(modulate(self.norm_out(x[:, n_txt:]), shift, scale))
        return self.unpatchify(out)
