"""RequestLogger: vLLM's --enable-log-requests, one log line per request as it reaches the engine, and with
--enable-log-outputs one per choice as the request ends."""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Optional

logger = logging.getLogger("pagedllm.entrypoints.logger")


class RequestLogger:
    """Logs a request's id, prompt, token ids, sampling parameters and adapter. ``max_log_len`` (None: all) cuts
    the prompt to that many characters and the token ids to that many ids, so long prompts keep logs short."""

    def __init__(self, *, max_log_len: Optional[int], log_outputs: bool = False) -> None:
        self.max_log_len = max_log_len
        self.log_outputs = log_outputs

    def _cut(self, value: Any) -> Any:
        return value if self.max_log_len is None or value is None else value[:self.max_log_len]

    def log_inputs(self, request_id: str, prompt: Optional[str], prompt_token_ids: Optional[list[int]],
                   params: Any, lora_request: Any = None) -> None:
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s.",
                    request_id, self._cut(prompt), params, self._cut(prompt_token_ids), lora_request)

    async def outputs_logged(self, request_id: str, results: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``results`` (an engine's RequestOutputs, whole or in deltas) passed on; once they end, each choice's text,
        token ids and finish reason logged (vLLM's --enable-log-outputs), cut as the inputs are."""
        texts: dict[int, str] = {}
        token_ids: dict[int, list[int]] = {}
        finish_reasons: dict[int, Optional[str]] = {}
        async for res in results:
            for output in res.outputs:
                texts[output.index] = texts.get(output.index, "") + output.text
                token_ids.setdefault(output.index, []).extend(output.token_ids)
                finish_reasons[output.index] = output.finish_reason
            yield res
        for index in sorted(texts):
            logger.info("Generated response %s (choice %d): output: %r, output_token_ids: %s, finish_reason: %s",
                        request_id, index, self._cut(texts[index]), self._cut(token_ids[index]),
                        finish_reasons[index])
