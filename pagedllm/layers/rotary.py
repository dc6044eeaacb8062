"""Rotary position embedding (neox / HF "rotate_half" layout).

cos/sin are computed per step from the positions in float32, as HF does, so
there is no position limit and no large cache to keep.
"""

import math

import torch
from torch import nn

from pagedllm.native import fused


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: slow down low frequencies, blend the middle band."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` dims of each q/k head by position."""

    def __init__(self, head_size: int, rotary_dim: int, base: float, rope_parameters: dict | None = None):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        rope_type = (rope_parameters or {}).get("rope_type", "default")
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_parameters)
        elif rope_type != "default":
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported")
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cos_sin_cache: tuple | None = None

    def forward(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """``qk`` is ``[T, heads * head_size]``: the query and key heads of the fused QKV output, which sit side
        by side, rotated in one pass. Returns them rotated: in place by the native kernel where it applies
        (float32 on CPU), else as a copy."""
        cos, sin = self._cos_sin(positions, qk.dtype)
        if fused.rotary_neox_(qk, qk.shape[-1] // self.head_size, self.head_size, self.rotary_dim, cos, sin):
            return qk
        return self._rotate(qk, cos, sin)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Computed once per step: the model's layers share this module and get the same positions tensor.
        The cache holds that tensor itself, so no later tensor can be mistaken for it (callers do not
        modify positions in place during a step)."""
        cached = self._cos_sin_cache
        if cached is None or cached[0] is not positions or cached[1] != dtype:
            freqs = positions.unsqueeze(-1).float() * self.inv_freq
            cached = (positions, dtype, freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1))
            self._cos_sin_cache = cached
        return cached[2], cached[3]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size)
        rot, passthrough = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if passthrough.shape[-1]:
            rotated = torch.cat((rotated, passthrough), dim=-1)
        return rotated.reshape(shape)


def get_rope(head_size: int, config) -> RotaryEmbedding:
    """Build the rotary embedding described by an HF config.

    transformers >= 5 keeps ``rope_theta`` inside ``config.rope_parameters``;
    older configs have ``config.rope_theta`` and ``config.rope_scaling``.
    """
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    rotary_dim = int(head_size * params.get("partial_rotary_factor", 1.0))
    return RotaryEmbedding(head_size, rotary_dim, base, params)
