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

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """vLLM's: merges the request's next output into this one, which its consumer has not taken yet. Each
        sequence (by index) of ``next_output`` extends its own here with its new text, tokens and logprobs where
        ``aggregate`` (DELTA outputs), else replaces it (CUMULATIVE outputs hold everything so far); a sequence not
        here yet (an n > 1 request's) is added. The rest is the later output's, an error kept once one came."""
        self.finished |= next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens
        self.error = self.error or next_output.error
        self.metrics = next_output.metrics
        for next_completion in next_output.outputs:
            at = next((i for i, c in enumerate(self.outputs) if c.index == next_completion.index), None)
            if at is None:
                self.outputs.append(next_completion)
            elif not aggregate:
                self.outputs[at] = next_completion
            else:
                completion = self.outputs[at]
                completion.text += next_completion.text
                completion.token_ids.extend(next_completion.token_ids)  # a delta's lists are its own
                if next_completion.logprobs:
                    completion.logprobs.extend(next_completion.logprobs)
                completion.cumulative_logprob = next_completion.cumulative_logprob
                completion.finish_reason = next_completion.finish_reason
                completion.stop_reason = next_completion.stop_reason
