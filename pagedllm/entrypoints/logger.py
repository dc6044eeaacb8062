"""RequestLogger: vLLM's --enable-log-requests, one log line per request as it reaches the engine."""
from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger("pagedllm.entrypoints.logger")


class RequestLogger:
    """Logs a request's id, prompt, token ids, sampling parameters and adapter. ``max_log_len`` (None: all) cuts
    the prompt to that many characters and the token ids to that many ids, so long prompts keep logs short."""

    def __init__(self, *, max_log_len: Optional[int]) -> None:
        self.max_log_len = max_log_len

    def log_inputs(self, request_id: str, prompt: Optional[str], prompt_token_ids: Optional[list[int]],
                   params: Any, lora_request: Any = None) -> None:
        if self.max_log_len is not None:
            prompt = None if prompt is None else prompt[:self.max_log_len]
            prompt_token_ids = None if prompt_token_ids is None else prompt_token_ids[:self.max_log_len]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s.",
                    request_id, prompt, params, prompt_token_ids, lora_request)
