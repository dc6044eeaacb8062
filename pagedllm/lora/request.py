"""LoRARequest: which adapter a request runs with (vLLM's vllm/lora/request.py)."""
from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """An adapter by name, id and path: ``LoRARequest("sql", 1, "/adapters/sql")``. As vLLM's, its fields may be set
    after it is made, and it is equal to (and hashes as) any LoRARequest of the same ``lora_name``.

    ``lora_int_id`` (>= 1) identifies the adapter inside the engine: its slot and its place in the worker's cache
    of loaded adapters (the prefix cache keys an adapter's blocks by its name and path, as vLLM's).
    Requests naming the same id must name the same adapter, unless ``load_inplace`` (vLLM's): the engine then reads
    the adapter's files again, and its weights replace those the id had (for its requests already running too).
    ``lora_path`` is a PEFT adapter directory (adapter_config.json and adapter_model.safetensors).
    ``is_3d_lora_weight``: vLLM's flag for mixture-of-experts adapters in fused 3D layouts, which its engine reads only
    with enable_mixed_moe_lora_format; taken, and as there (without that setting) it changes nothing."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Each field as the engine process decodes it (a str, an int64 id), so that what it could not read, and which
        would end it (or a step, for an id past int64), is this ValueError where the request is made (and, for one
        changed since, where it is passed: Processor.validate_lora_request)."""
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or not 1 <= self.lora_int_id < 2**63):
            raise ValueError(f"lora_int_id must be an integer from 1 to 2**63 - 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a string naming the adapter's directory (adapter {self.lora_name!r}), "
                             f"got {self.lora_path!r}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"base_model_name must be a string or None, got {self.base_model_name!r}")
        for flag in ("load_inplace", "is_3d_lora_weight"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        """vLLM's: one adapter is one name, whatever the id or path a request gives it."""
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
