"""Rotary position embedding (neox / HF "rotate_half" layout).

cos/sin come from a table computed in float32 with HF's formulas (position * inv_freq, then cos and sin, times
the rope type's attention factor; see rope_scaling.py for the types), so every value equals HF's; it covers the
positions the model serves (the engine's max_model_len never exceeds them) and grows past that on demand. Looking
rows up by position in the kernel, as vLLM's cos_sin_cache does, keeps the step's per-token work inside native
calls (see native/graph.py).
"""

import torch
from torch import nn

from pagedllm.layers import rope_scaling
from pagedllm.native import fused


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` dims of each q/k head by position."""

    def __init__(self, head_size: int, rotary_dim: int, base: float, rope_parameters: dict | None = None,
                 max_position: int = 2048, num_positions: int | None = None):
        """``rope_parameters``: standardised (rope_scaling.rope_parameters), ``rope_theta`` aside: ``base`` is the
        theta. ``max_position``: the config's max_position_embeddings. ``num_positions``: the positions the table
        starts with, the model's (default: those these parameters' scaling serves from max_position)."""
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.rope_parameters = {"rope_type": "default", **(rope_parameters or {}), "rope_theta": base}
        self.max_position = max_position
        if num_positions is None:
            num_positions = rope_scaling.scaled_max_position(self.rope_parameters, max_position)
        self.register_buffer("cos_sin_cache", self._table(num_positions), persistent=False)
        self._step_cos_sin: tuple | None = None

    def _table(self, num_positions: int) -> torch.Tensor:
        """``[num_positions, rotary_dim]`` float32: per position its rotary_dim / 2 cosines, then sines. Each row
        is a function of its position alone, so a grown table keeps the rows it had."""
        positions = torch.arange(num_positions)
        inv_freq, scale = rope_scaling.inv_freq_and_scale(self.rope_parameters, self.rotary_dim, self.max_position,
                                                          positions)
        freqs = positions.float().unsqueeze(-1) * inv_freq
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * scale

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


def get_rope(head_size: int, config, layer_type: str | None = None) -> RotaryEmbedding:
    """Build the rotary embedding described by an HF config (its rope parameters standardised as transformers
    does, see rope_scaling.rope_parameters), or by its parameters for layers of ``layer_type``. Its table covers
    the positions the model serves (rope_scaling.positions_served, which bounds the engine's max_model_len): for
    Gemma 3's global layers, whose own scaling would stretch it 8 times (1 GiB for the 4B model), no more."""
    params = rope_scaling.rope_parameters(config, layer_type)
    rotary_dim = int(head_size * params["partial_rotary_factor"])
    return RotaryEmbedding(head_size, rotary_dim, params["rope_theta"], params,
                           rope_scaling.max_position_embeddings(config), rope_scaling.positions_served(config))
