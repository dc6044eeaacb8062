"""The engine's step timeline, for profiling serving: with PAGEDLLM_STEP_TRACE=FILE the engine appends one JSON line
per step to FILE (FILE.<rank> for data-parallel rank > 0); benchmarks/step_timeline.py summarizes it.

Each line: `t` (the step's start, time.time()), the phases in milliseconds — `schedule`, `execute` (the model,
sampling included), `update` (stop checks, outputs) — and `gap`, the time since the previous step ended (taking
inputs, sending outputs, idling with nothing to run); then the step's work: `reqs`, `tokens`, `prefill_tokens`
and `prefill_reqs` (requests whose scheduled tokens are more than one plus their drafts: prompt chunks, and
recomputation after a preemption), `decode_reqs`. Off (no cost beyond one attribute test a step) unless the
variable is set.
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional

from pagedllm.core.sched.output import SchedulerOutput

STEP_TRACE_ENV = "PAGEDLLM_STEP_TRACE"


class StepTrace:
    def __init__(self, path: str) -> None:
        # Line-buffered: the engine process ends with os._exit, which flushes nothing.
        self._file = open(path, "a", buffering=1)
        self._last_end: Optional[float] = None

    @classmethod
    def from_env(cls, data_parallel_rank: int = 0) -> Optional["StepTrace"]:
        path = os.environ.get(STEP_TRACE_ENV)
        if not path:
            return None
        return cls(path if data_parallel_rank == 0 else f"{path}.{data_parallel_rank}")

    def record(self, scheduler_output: SchedulerOutput, start: float, scheduled: float, executed: float,
               end: float) -> None:
        """``start`` .. ``end``: time.perf_counter() at the step's start, after schedule(), after the model ran,
        and at its end."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        prefill = [n for req_id, n in scheduler_output.num_scheduled_tokens.items()
                   if n > 1 + len(spec.get(req_id, ()))]
        gap = (start - self._last_end) * 1e3 if self._last_end is not None else 0.0
        self._last_end = end
        self._file.write(json.dumps({
            "t": round(time.time() - (time.perf_counter() - start), 4), "gap": round(gap, 3),
            "schedule": round((scheduled - start) * 1e3, 3), "execute": round((executed - scheduled) * 1e3, 3),
            "update": round((end - executed) * 1e3, 3),
            "reqs": len(scheduler_output.num_scheduled_tokens),
            "tokens": scheduler_output.total_num_scheduled_tokens, "prefill_tokens": sum(prefill),
            "prefill_reqs": len(prefill),
            "decode_reqs": len(scheduler_output.num_scheduled_tokens) - len(prefill)}) + "\n")
