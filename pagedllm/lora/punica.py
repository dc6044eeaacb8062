"""The rows of each adapter slot in a step (the part of vLLM's PunicaWrapper that maps tokens to adapters).

One PunicaWrapper per model: the model runner sets the step's token -> slot mapping once, every LoRA'd layer reads
it (lora/layers.py does its shrink and expand per group, never a per-row loop). Rows of no adapter (slot -1) are
in no group.
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
