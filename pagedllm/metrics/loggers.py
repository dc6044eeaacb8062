"""The server's periodic log line (vLLM's LoggingStatLogger): every ``interval`` seconds, by a timer of its own, per
engine that did something in that interval or the one before (so the line after a burst shows it over, then it
goes quiet while idle, as vLLM's), the prompt (computed, not cached) and generation throughput over the interval,
running and waiting requests (and of those waiting, the deferred ones when there are any), the preemptions in the
interval (when there were any), KV cache usage and the prefix cache's hit rate over the last 1000 requests that
looked it up since it was last reset (when any has); with speculative decoding a second line (vLLM's
SpecDecodingLogging) with the mean acceptance length, accepted and drafted throughput and tokens, the acceptance rate
per draft position and overall, all over the interval. Off with ``--disable-log-stats``; offline, on with
``LLM(disable_log_stats=False)``."""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from typing import Optional

from prometheus_client import REGISTRY

from pagedllm.engine.protocol import SchedulerStats
from pagedllm.metrics.logger_factories import aggregate
from pagedllm.metrics.prometheus import PrometheusStatLogger, unregister_pagedllm_metrics
from pagedllm.metrics.stats import IterationStats

logger = logging.getLogger(__name__)

LOG_STATS_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL default
MAX_RECENT_REQUESTS = 1000  # the prefix cache hit rate's window (vLLM's CachingMetrics)
MIN_INTERVAL_S = 0.1  # the timer's shortest tick (an interval of 0: every tick)


def log_stats_interval() -> float:
    """PAGEDLLM_LOG_STATS_INTERVAL's seconds (default 10; 0: every tick): a value that is no finite non-negative number
    is a ValueError naming the variable when the server starts, not a logging thread that dies in silence."""
    value = os.environ.get("PAGEDLLM_LOG_STATS_INTERVAL", str(LOG_STATS_INTERVAL_S))
    try:
        interval = float(value)
    except ValueError:
        interval = math.nan
    if not 0 <= interval < math.inf:
        raise ValueError(f"PAGEDLLM_LOG_STATS_INTERVAL must be a number of seconds (0 or more), got {value!r}")
    return interval


class LoggingStatLogger:
    def __init__(self, num_engines: int = 1, interval: float = LOG_STATS_INTERVAL_S, clock=time.monotonic,
                 timer: bool = True):
        """``timer``: log every ``interval`` from a daemon thread (tests call log() themselves)."""
        self.interval, self.clock = interval, clock
        self._lock = threading.Lock()  # record() runs on the server's loop, log() on the timer's thread
        self._engines = [_EngineWindow(clock()) for _ in range(num_engines)]
        self._idle = [True] * num_engines  # whether each engine's last interval was idle
        if timer:
            threading.Thread(target=self._log_every_interval, name="log-stats", daemon=True).start()

    def record(self, scheduler_stats: Optional[SchedulerStats], iteration_stats: Optional[IterationStats],
               engine_idx: int = 0) -> None:
        with self._lock:
            self._engines[engine_idx].add(scheduler_stats, iteration_stats)

    def log(self) -> None:
        """The interval's lines of each engine that was not idle in it or in the one before; a new interval."""
        now = self.clock()
        with self._lock:
            for engine, window in enumerate(self._engines):
                idle = window.idle()
                if not (idle and self._idle[engine]):
                    for line in window.lines(engine, now):
                        logger.info(line)
                self._idle[engine] = idle
                window.restart(now)

    def due(self) -> bool:
        """Whether an interval has passed since the last line: the offline engine logs then, after a step with
        outputs (vLLM's do_log_stats_with_interval), which needs no timer thread."""
        return self.clock() - self._engines[0].start >= self.interval

    def _log_every_interval(self) -> None:
        while True:
            time.sleep(max(self.interval, MIN_INTERVAL_S))
            self.log()


class _CachingWindow:
    """vLLM's CachingMetrics: the prefix cache's queries and hits of the most recent requests that looked it up (at
    most MAX_RECENT_REQUESTS, a step's requests dropped together, its latest always kept), whatever the interval:
    a line of an interval in which nothing was admitted still says how the cache has been doing."""

    def __init__(self):
        self.steps: deque[tuple[int, int, int]] = deque()  # (requests, queries, hits) of each step that had any
        self.requests = self.queries = self.hits = 0

    def observe(self, requests: int, queries: int, hits: int) -> None:
        if requests <= 0:  # no lookup; or an engine that died reporting nothing held
            return
        self.steps.append((requests, queries, hits))
        self.requests, self.queries, self.hits = self.requests + requests, self.queries + queries, self.hits + hits
        while len(self.steps) > 1 and self.requests > MAX_RECENT_REQUESTS:
            old_requests, old_queries, old_hits = self.steps.popleft()
            self.requests, self.queries, self.hits = (self.requests - old_requests, self.queries - old_queries,
                                                      self.hits - old_hits)


class _EngineWindow:
    """One engine's figures since its last log line: token counts summed, the scheduler's totals at its start and
    latest; and its prefix cache's recent hit rate."""

    def __init__(self, start: float):
        self.first: Optional[SchedulerStats] = None  # the totals the window started from
        self.latest: Optional[SchedulerStats] = None
        self.prefix_cache = _CachingWindow()
        self.restart(start)

    def restart(self, start: float) -> None:
        self.start, self.prompt_tokens, self.generation_tokens = start, 0, 0
        self.first = self.latest

    def add(self, scheduler_stats: Optional[SchedulerStats], iteration_stats: Optional[IterationStats]) -> None:
        if iteration_stats is not None:  # the prompt tokens computed: those the prefix cache held cost nothing
            self.prompt_tokens += iteration_stats.num_prompt_tokens - iteration_stats.num_cached_prompt_tokens
            self.generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            before = self.latest or SchedulerStats()
            if scheduler_stats.prefix_cache_resets != before.prefix_cache_resets:
                # vLLM's CachingMetrics.reset: hits counted before the cache was emptied say nothing of it now.
                self.prefix_cache = _CachingWindow()
            self.prefix_cache.observe(scheduler_stats.prefix_cache_requests - before.prefix_cache_requests,
                                      scheduler_stats.prefix_cache_queries - before.prefix_cache_queries,
                                      scheduler_stats.prefix_cache_hits - before.prefix_cache_hits)
            self.latest = scheduler_stats

    def idle(self) -> bool:
        """No tokens in the window and no request running or waiting at its end."""
        latest = self.latest or SchedulerStats()
        return not (self.prompt_tokens or self.generation_tokens or latest.num_running_reqs
                    or latest.num_waiting_reqs or latest.num_skipped_waiting_reqs)

    def lines(self, engine: int, now: float) -> list[str]:
        seconds = max(now - self.start, 1e-9)
        latest, first = self.latest or SchedulerStats(), self.first or SchedulerStats()
        prefix_cache = self.prefix_cache
        preemptions = latest.num_preemptions - first.num_preemptions
        deferred = latest.num_skipped_waiting_reqs
        lines = [f"Engine {engine:03d}: Avg prompt throughput: {self.prompt_tokens / seconds:.1f} tokens/s, "
                 f"Avg generation throughput: {self.generation_tokens / seconds:.1f} tokens/s, "
                 f"Running: {latest.num_running_reqs} reqs, Waiting: {latest.num_waiting_reqs + deferred} reqs, "
                 f"{f'Deferred: {deferred} reqs, ' if deferred > 0 else ''}"
                 f"{f'Preemptions: {preemptions}, ' if preemptions > 0 else ''}"
                 f"KV cache usage: {100 * latest.kv_cache_usage:.1f}%"
                 + (f", Prefix cache hit rate: {100 * prefix_cache.hits / max(prefix_cache.queries, 1):.1f}%"
                    if prefix_cache.requests else "")]
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


def default_stat_loggers() -> list:
    """vLLM's stat loggers of an AsyncLLM made without any, as factories of the config: the log line (no timer: it
    logs when do_log_stats() asks, as vLLM's) and the pagedllm: metrics in prometheus_client's default registry, an
    earlier engine's unregistered first. A bad PAGEDLLM_LOG_STATS_INTERVAL fails here, before any process."""
    interval = log_stats_interval()

    @aggregate
    def prometheus(config) -> PrometheusStatLogger:
        unregister_pagedllm_metrics(REGISTRY)
        return PrometheusStatLogger.from_config(config.model_config.model, REGISTRY, config)

    @aggregate
    def log_line(config) -> LoggingStatLogger:
        return LoggingStatLogger(config.parallel_config.data_parallel_size, interval, timer=False)

    return [prometheus, log_line]
