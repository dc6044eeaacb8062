"""The rows of each adapter slot in a step, and the shrink/expand that adds an adapter to them (the idea of vLLM's
PunicaWrapper and its SGMV kernels, on torch's GEMMs).

One PunicaWrapper per model: the model runner sets the step's token -> slot mapping once, every LoRA'd layer reads
it. Rows are grouped by slot, so each layer does per slot and slice one shrink ``x_rows @ A.T`` (``[rows, r]``)
and one expand ``@ B.T``: two small GEMMs over the slot's rows, never a per-row loop. Rows of no adapter (slot -1)
are not touched, so they are bit for bit what the base model computes.
"""
from __future__ import annotations

import torch


class PunicaWrapper:
    def __init__(self) -> None:
        # (slot, rows): rows an index tensor into the step's tokens, or None when every token uses the slot
        self.groups: list[tuple[int, torch.Tensor | None]] = []

    def update(self, token_slots: torch.Tensor) -> None:
        """``token_slots[i]``: the slot of token i's adapter, -1 for the base model."""
        self.groups = []
        if token_slots.numel() == 0 or int(token_slots.max()) < 0:
            return
        for slot in torch.unique(token_slots[token_slots >= 0]).tolist():
            rows = torch.nonzero(token_slots == slot).flatten()
            self.groups.append((slot, None if rows.numel() == token_slots.numel() else rows))

    def clear(self) -> None:
        self.groups = []

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
                 output_slices: list[tuple[int, int]], ranks: list[list[int]]) -> None:
        """``y[rows, slice] += x[rows] @ A[slot].T @ B[slot].T`` for each slot's rows and each output slice, in
        place. ``lora_a[i]``: ``[max_loras, max_rank, in]``; ``lora_b[i]``: ``[max_loras, out_i, max_rank]`` (B
        already scaled); ``output_slices[i]``: ``(offset, size)`` of slice i in ``y``'s last dimension;
        ``ranks[slot][i]``: the rank of the slot's adapter on slice i, 0 where it has none."""
        for slot, rows in self.groups:
            xs = x if rows is None else x.index_select(0, rows)
            for i, (offset, size) in enumerate(output_slices):
                r = ranks[slot][i]
                if r == 0:
                    continue
                delta = (xs @ lora_a[i][slot, :r].T) @ lora_b[i][slot, :, :r].T
                target = y[:, offset:offset + size]
                if rows is None:
                    target += delta
                else:
                    target.index_add_(0, rows, delta)
