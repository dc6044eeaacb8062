"""LoRARequest: which adapter a request runs with (vLLM's vllm/lora/request.py)."""
from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """An adapter by name, id and path: ``LoRARequest("sql", 1, "/adapters/sql")``.

    ``lora_int_id`` (>= 1) identifies the adapter inside the engine: its slot, its KV blocks (the prefix cache
    keys blocks by it, so two adapters never share one) and its place in the worker's cache of loaded adapters.
    Requests naming the same id must name the same adapter. ``lora_path`` is a PEFT adapter directory
    (adapter_config.json and adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's directory (adapter {self.lora_name!r})")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
