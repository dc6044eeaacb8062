"""RequestOutput and CompletionOutput: what LLM.generate returns and the server streams, as in vLLM."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.stats import RequestStateStats


class Logprob(NamedTuple):
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per position: token id -> Logprob (the chosen token and the top-k alternatives).
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt position; the first position has nothing to condition on, so it is None.
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # Set when the engine refused the request instead of running it.
    error: Optional[str] = None
    # vLLM's: the request's timings and counts, with stat logging on (the server; LLM(disable_log_stats=False)).
    metrics: Optional[RequestStateStats] = None
    # vLLM's: the LoRA adapter the request ran with (None: the base model).
    lora_request: Optional[LoRARequest] = None
