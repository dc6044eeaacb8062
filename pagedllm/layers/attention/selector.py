"""Choose the attention backend by name (vLLM's --attention-backend; the platform checks the name and supplies its
default, platforms/interface.py).

The model loader sets the engine's choice around a model's construction (use_attention_backend), so that every
Attention layer the model builds takes it without each model passing it down; two engines in one process each
set their own. The Triton backend's module imports triton, so it is imported only when chosen."""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from pagedllm.layers.attention.backend import AttentionBackend
from pagedllm.layers.attention.cpu_backend import TorchSDPABackend

# Every attention backend by name (each platform offers some: Platform.attention_backends).
ATTENTION_BACKENDS = (TorchSDPABackend.get_name(), "TRITON_ATTN")
# vLLM's names for them: its CPU backend (CPU_ATTN) is this engine's TORCH_SDPA.
ATTENTION_BACKEND_ALIASES = {"CPU_ATTN": TorchSDPABackend.get_name()}
_current_backend: ContextVar[str] = ContextVar("attention_backend", default=TorchSDPABackend.get_name())


def attention_backend_name(name: Any) -> Any:
    """A backend name as vLLM's AttentionConfig reads it: in any case, "auto" (None: the platform's default), or a
    vLLM alias, as the name of this engine's backend. Any other value comes back as it is, for the platform to
    refuse naming its choices (Platform.check_attention_backend)."""
    if not isinstance(name, str):
        return name
    upper = name.upper()
    if upper == "AUTO":
        return None
    upper = ATTENTION_BACKEND_ALIASES.get(upper, upper)
    return upper if upper in ATTENTION_BACKENDS else name


@contextmanager
def use_attention_backend(name: str) -> Iterator[None]:
    """Attention layers built inside this block run backend ``name``."""
    token = _current_backend.set(name)
    try:
        yield
    finally:
        _current_backend.reset(token)


def get_attn_backend(name: str | None = None) -> type[AttentionBackend]:
    """The backend called ``name``; None: the one use_attention_backend set (TORCH_SDPA outside it)."""
    name = name or _current_backend.get()
    if name == TorchSDPABackend.get_name():
        return TorchSDPABackend
    if name == "TRITON_ATTN":
        from pagedllm.layers.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend
    raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}")
