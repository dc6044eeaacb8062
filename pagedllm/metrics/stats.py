"""Per-iteration request statistics gathered in the frontend, for the Prometheus metrics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    queued_time: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one batch of engine outputs did, as seen by the frontend (wall-clock times)."""

    # Prompt tokens of requests that got their first token in this iteration.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
