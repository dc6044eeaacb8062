"""ModelRunnerOutput: what a worker returns for one step, indexed by the batch order it used."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # Per request: the tokens sampled this step (empty for a prefill chunk that has not reached the prompt end).
    sampled_token_ids: list[list[int]]
    # Per request (same index): the logprobs rows for its sampled tokens, or None.
    logprobs: Optional[list[Any]] = None
    # req_id -> prompt logprobs of the prompt positions computed this step.
    prompt_logprobs_dict: dict[str, Any] = field(default_factory=dict)
    # Speculative decoding: per request (same index), the draft tokens proposed for its next step; None when
    # speculation is off.
    spec_token_ids: Optional[list[list[int]]] = None
    # The step captured a CPU graph: its time is the capture's (several steps' worth), not what such a step costs.
    captured_graph: bool = False


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
