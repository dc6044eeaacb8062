"""Environment variables read as vLLM's envs.py reads its VLLM_ ones, under the PAGEDLLM_ prefix."""
from __future__ import annotations

import os


def env_flag(name: str, default: bool) -> bool:
    """An on/off variable: an integer, read as vLLM reads its flags (bool(int(...))), so that "false" is a ValueError
    naming the variable, not "on"."""
    value = os.environ.get(name, str(int(default)))
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"{name} must be 0 or 1, got {value!r}") from None
