"""The server's periodic log line (vLLM's LoggingStatLogger): every ``interval`` seconds in which engines produced
output, per engine, the prompt and generation throughput since the last line, running and waiting requests, KV
cache usage and the prefix cache's hit rate; with speculative decoding a second line (vLLM's SpecDecodingLogging)
with the mean acceptance length, accepted and drafted throughput and tokens, the acceptance rate per draft position
and overall, all over the interval. Off with ``--disable-log-stats``."""
from __future__ import annotations

import logging
import time
from typing import Optional

from pagedllm.engine.protocol import SchedulerStats
from pagedllm.metrics.stats import IterationStats

logger = logging.getLogger(__name__)

LOG_STATS_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL default


class LoggingStatLogger:
    def __init__(self, num_engines: int = 1, interval: float = LOG_STATS_INTERVAL_S, clock=time.monotonic):
        self.interval, self.clock = interval, clock
        self._engines = [_EngineWindow(clock()) for _ in range(num_engines)]

    def record(self, scheduler_stats: Optional[SchedulerStats], iteration_stats: Optional[IterationStats],
               engine: int = 0) -> None:
        window = self._engines[engine]
        window.add(scheduler_stats, iteration_stats)
        now = self.clock()
        if now - window.start >= self.interval:
            for line in window.lines(engine, now):
                logger.info(line)
            window.restart(now)


class _EngineWindow:
    """One engine's figures since its last log line: token counts summed, the scheduler's totals at its start and
    latest."""

    def __init__(self, start: float):
        self.first: Optional[SchedulerStats] = None  # the totals the window started from
        self.latest: Optional[SchedulerStats] = None
        self.restart(start)

    def restart(self, start: float) -> None:
        self.start, self.prompt_tokens, self.generation_tokens = start, 0, 0
        self.first = self.latest

    def add(self, scheduler_stats: Optional[SchedulerStats], iteration_stats: Optional[IterationStats]) -> None:
        if iteration_stats is not None:
            self.prompt_tokens += iteration_stats.num_prompt_tokens
            self.generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            self.latest = scheduler_stats

    def lines(self, engine: int, now: float) -> list[str]:
        seconds = max(now - self.start, 1e-9)
        latest, first = self.latest or SchedulerStats(), self.first or SchedulerStats()
        queries = latest.prefix_cache_queries - first.prefix_cache_queries
        hits = latest.prefix_cache_hits - first.prefix_cache_hits
        lines = [f"Engine {engine:03d}: Avg prompt throughput: {self.prompt_tokens / seconds:.1f} tokens/s, "
                 f"Avg generation throughput: {self.generation_tokens / seconds:.1f} tokens/s, "
                 f"Running: {latest.num_running_reqs} reqs, Waiting: {latest.num_waiting_reqs} reqs, "
                 f"KV cache usage: {100 * latest.kv_cache_usage:.1f}%, "
                 f"Prefix cache hit rate: {100 * hits / max(queries, 1):.1f}%"]
        drafts = latest.spec_decode_num_drafts - first.spec_decode_num_drafts
        if drafts > 0:
            drafted = latest.spec_decode_num_draft_tokens - first.spec_decode_num_draft_tokens
            accepted = latest.spec_decode_num_accepted_tokens - first.spec_decode_num_accepted_tokens
            before = first.spec_decode_num_accepted_tokens_per_pos
            per_pos = [(n - (before[i] if i < len(before) else 0)) / drafts
                       for i, n in enumerate(latest.spec_decode_num_accepted_tokens_per_pos)]
            lines.append(f"Engine {engine:03d}: SpecDecoding metrics: Mean acceptance length: "
                         f"{1 + accepted / drafts:.2f}, Accepted throughput: {accepted / seconds:.2f} tokens/s, "
                         f"Drafted throughput: {drafted / seconds:.2f} tokens/s, Accepted: {accepted} tokens, "
                         f"Drafted: {drafted} tokens, Per-position acceptance rate: "
                         f"{', '.join(f'{rate:.3f}' for rate in per_pos)}, "
                         f"Avg Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%")
        return lines
