"""Rotary position embedding (neox / HF "rotate_half" layout).

cos/sin come from a table computed once in float32 with HF's formula (position * inv_freq, then cos and
sin), so every value equals HF's; it covers the model's max_position_embeddings (the engine's max_model_len
never exceeds it) and grows past that on demand. Looking rows up by position in the kernel, as vLLM's
cos_sin_cache does, keeps the step's per-token work inside native calls (see native/graph.py).
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

    def __init__(self, head_size: int, rotary_dim: int, base: float, rope_parameters: dict | None = None,
                 max_position: int = 2048):
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
        self.register_buffer("cos_sin_cache", self._table(max_position), persistent=False)
        self._step_cos_sin: tuple | None = None

    def _table(self, num_positions: int) -> torch.Tensor:
        """``[num_positions, rotary_dim]`` float32: per position its rotary_dim / 2 cosines, then sines."""
        freqs = torch.arange(num_positions, dtype=torch.float).unsqueeze(-1) * self.inv_freq
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def forward(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """``qk`` is ``[T, heads * head_size]``: the query and key heads of the fused QKV output, which sit side
        by side, rotated in one pass. Returns them rotated: in place by the native kernel where it applies
        (float32 on CPU), else as a copy."""
        try:
            return self._rotate_by(positions, qk)
        except IndexError:  # a position past the table (not in the engine: its max_model_len fits the table)
            self.cos_sin_cache = self._table(int(positions.max()) + 1)
            return self._rotate_by(positions, qk)

    def _rotate_by(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        heads = qk.shape[-1] // self.head_size
        if fused.rotary_neox_(qk, heads, self.head_size, self.rotary_dim, positions, self.cos_sin_cache):
            return qk
        cos, sin = self._cos_sin(positions, qk.dtype)
        return self._rotate(qk, cos, sin)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """For the torch path, looked up once per step: the model's layers share this module and get the same
        positions tensor. The cache holds that tensor itself, so no later tensor can be mistaken for it
        (callers do not modify positions in place during a step)."""
        cached = self._step_cos_sin
        if cached is None or cached[0] is not positions or cached[1] != dtype:
            cos, sin = self.cos_sin_cache.index_select(0, positions.long()).to(dtype).chunk(2, dim=-1)
            cached = (positions, dtype, cos.unsqueeze(1), sin.unsqueeze(1))
            self._step_cos_sin = cached
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
    max_position = getattr(config, "max_position_embeddings", None) or 2048
    return RotaryEmbedding(head_size, rotary_dim, base, params, max_position)
