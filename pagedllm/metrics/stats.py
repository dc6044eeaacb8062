"""Per-iteration request statistics gathered in the frontend, for the Prometheus metrics (vLLM's
v1/metrics/stats.py, wall-clock times)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestStateStats:
    """A request's figures so far, vLLM's RequestOutput.metrics (with stat logging on; else None). Times are the
    frontend's wall clock (vLLM's *_ts are the engine core's monotonic one); queued_ts is the arrival, as the engine
    queues a request when it arrives."""

    num_generation_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0  # first scheduled (a preemption's rescheduling leaves it)
    first_token_ts: float = 0.0  # 0 until the first token
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0


@dataclass
class FinishedRequestStats:
    """A request's figures once it finishes. Its phases, as vLLM splits them: queued from arrival to first being
    scheduled, prefill from then to the first token, decode from the first token to the last, inference from
    first scheduled to the last token (preemptions fall inside the phase they interrupt)."""

    finish_reason: str
    e2e_latency: float
    queued_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    prefill_time: float = 0.0
    decode_time: float = 0.0
    inference_time: float = 0.0
    # decode_time over the tokens after the first (the first is the prefill's); 0 with one token or none
    mean_time_per_output_token: float = 0.0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    max_tokens_param: int | None = None


@dataclass
class IterationStats:
    """What one batch of engine outputs did, as seen by the frontend (wall-clock times)."""

    # Prompt tokens of requests that got their first token in this iteration, and those of them the prefix
    # cache held.
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # Per user request whose every sequence finished in this iteration: its n, and the most tokens one of its
    # sequences generated.
    n_params_iter: list[int] = field(default_factory=list)
    max_num_generation_tokens_iter: list[int] = field(default_factory=list)
