"""Each token's adapter slot in a step (the part of vLLM's PunicaWrapper that maps tokens to adapters).

One PunicaWrapper per model: the model runner sets the step's token -> slot mapping once, and every LoRA'd layer
reads it: lora.c straight from ``token_slots`` (which a CPU graph step points at its static buffer), the torch path
through ``groups()``, the rows of each slot. Rows of no adapter (slot -1) are in no group.
"""
from __future__ import annotations

import torch


class PunicaWrapper:
    def __init__(self) -> None:
        self.token_slots = torch.empty(0, dtype=torch.int64)  # token i's slot, -1 for the base model
        self.active = False  # whether any token of the step has an adapter
        # Whether a LoRA'd layer runs torch ops in this step (an adapter on the token embedding), which a CPU graph
        # does not replay: the step then runs eagerly. Set by the worker's LoRA manager, kept by update().
        self.needs_eager = False
        self._groups: list[tuple[int, torch.Tensor | None]] | None = None

    def update(self, token_slots: torch.Tensor) -> None:
        """``token_slots[i]``: the slot of token i's adapter, -1 for the base model (int64)."""
        self.token_slots = token_slots.contiguous()
        self.active = token_slots.numel() > 0 and int(token_slots.max()) >= 0
        self._groups = None

    def clear(self) -> None:
        self.update(torch.empty(0, dtype=torch.int64))

    def groups(self) -> list[tuple[int, torch.Tensor | None]]:
        """(slot, rows) per slot the step uses: rows an index tensor into the step's tokens, or None when every
        token uses the slot."""
        if self._groups is None:
            slots = self.token_slots
            self._groups = []
            for slot in torch.unique(slots[slots >= 0]).tolist():
                rows = torch.nonzero(slots == slot).flatten()
                self._groups.append((slot, None if rows.numel() == slots.numel() else rows))
        return self._groups


def lora_active(lora) -> bool:
    """Whether a layer's adapter slots (``lora``: lora/layers.py's, None where the layer has none) add to its output
    in this step: only a step with adapters runs them."""
    return lora is not None and lora.punica.active


def add_lora(lora, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y``, the output of a layer with input ``x``, with the step's adapters added in place where lora_active."""
    if lora_active(lora):
        lora.add_to(y, x)
    return y
