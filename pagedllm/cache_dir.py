"""Where pagedllm keeps what it derives once and reuses across processes (GGUF configs, built kernels)."""

import os


def cache_root() -> str:
    """``$PAGEDLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedllm``, else ``~/.cache/pagedllm``; delete it freely."""
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(xdg, "pagedllm")
