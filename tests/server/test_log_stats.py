"""The server's periodic log line (metrics/loggers.LoggingStatLogger, vLLM's LoggingStatLogger and
SpecDecodingLogging): figures over the interval since the last line, per engine, logged by a timer each interval
(here called by hand), quiet once an engine has been idle for an interval. tests/server/test_spec_decode_api.py
sees the line in a server's log."""
from __future__ import annotations

import logging
import time

import pytest

from pagedllm.engine.protocol import SchedulerStats
from pagedllm.metrics.loggers import LoggingStatLogger, log_stats_interval
from pagedllm.metrics.stats import IterationStats


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_per_interval_with_the_intervals_figures(caplog):
    clock = Clock()
    stat_logger = LoggingStatLogger(num_engines=2, interval=10.0, clock=clock, timer=False)
    caplog.set_level(logging.INFO, logger="pagedllm.metrics.loggers")
    first = SchedulerStats(num_running_reqs=3, prefix_cache_queries=100, prefix_cache_hits=50, prefix_cache_requests=2,
                           spec_decode_num_drafts=10, spec_decode_num_draft_tokens=40,
                           spec_decode_num_accepted_tokens=20, spec_decode_num_accepted_tokens_per_pos=[8, 6, 4, 2])
    clock.now = 109.0
    stat_logger.record(first, IterationStats(num_prompt_tokens=300, num_generation_tokens=20), engine_idx=1)
    assert not caplog.records  # a record logs nothing: the timer's tick does
    clock.now = 110.0
    stat_logger.record(first, IterationStats(num_generation_tokens=30), engine_idx=1)
    stat_logger.log()  # engine 0 was idle, and idle the interval before: no line
    (line, spec) = [r.getMessage() for r in caplog.records]
    assert line == ("Engine 001: Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: 50.0%")
    assert spec == ("Engine 001: SpecDecoding metrics: Mean acceptance length: 3.00, Accepted throughput: "
                    "2.00 tokens/s, Drafted throughput: 4.00 tokens/s, Accepted: 20 tokens, Drafted: 40 tokens, "
                    "Per-position acceptance rate: 0.800, 0.600, 0.400, 0.200, Avg Draft acceptance rate: 50.0%")
    caplog.clear()
    # The next interval counts from the totals the last line ended at (the prefix cache's hit rate, over the recent
    # requests, from start-up here).
    later = SchedulerStats(kv_cache_usage=0.25, prefix_cache_queries=200, prefix_cache_hits=60, prefix_cache_requests=4,
                           spec_decode_num_drafts=20, spec_decode_num_draft_tokens=80,
                           spec_decode_num_accepted_tokens=30, spec_decode_num_accepted_tokens_per_pos=[12, 9, 6, 3])
    clock.now = 125.0
    stat_logger.record(later, IterationStats(num_generation_tokens=15), engine_idx=1)
    stat_logger.log()
    (line, spec) = [r.getMessage() for r in caplog.records]
    assert "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 1.0 tokens/s" in line
    assert "KV cache usage: 25.0%, Prefix cache hit rate: 30.0%" in line
    assert ("Mean acceptance length: 2.00" in spec and "Accepted: 10 tokens, Drafted: 40 tokens" in spec
            and "Per-position acceptance rate: 0.400, 0.300, 0.200, 0.100, Avg Draft acceptance rate: 25.0%" in spec)


def test_no_speculation_no_spec_line(caplog):
    clock = Clock()
    stat_logger = LoggingStatLogger(interval=1.0, clock=clock, timer=False)
    caplog.set_level(logging.INFO, logger="pagedllm.metrics.loggers")
    clock.now = 101.0
    stat_logger.record(SchedulerStats(num_waiting_reqs=2), IterationStats(num_generation_tokens=4))
    stat_logger.log()
    assert [r.getMessage() for r in caplog.records] == [
        "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 4.0 tokens/s, Running: 0 reqs, "
        "Waiting: 2 reqs, KV cache usage: 0.0%"]  # no request looked the prefix cache up: no hit rate


def test_deferred_requests_count_as_waiting_and_are_named(caplog):
    """vLLM's line: Waiting counts every waiting request, then Deferred those of them passed over for something other
    than the step's capacity (a grammar compiling, no LoRA slot free); an engine holding only those is not idle."""
    clock = Clock()
    stat_logger = LoggingStatLogger(interval=1.0, clock=clock, timer=False)
    caplog.set_level(logging.INFO, logger="pagedllm.metrics.loggers")
    clock.now = 101.0
    stat_logger.record(SchedulerStats(num_running_reqs=1, num_waiting_reqs=2, num_skipped_waiting_reqs=3), None)
    stat_logger.log()
    clock.now = 102.0
    stat_logger.record(SchedulerStats(num_skipped_waiting_reqs=1), None)
    stat_logger.log()
    stat_logger.log()
    first, second, third = [r.getMessage().split(", KV")[0] for r in caplog.records]
    figures = "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
    assert first == figures + "Running: 1 reqs, Waiting: 5 reqs, Deferred: 3 reqs"
    assert second == third == figures + "Running: 0 reqs, Waiting: 1 reqs, Deferred: 1 reqs"


def test_the_interval_after_a_burst_is_logged_then_idle_ones_are_not(caplog):
    """As vLLM's: the tick after the last tokens shows the engine idle (Running: 0), later idle ticks log nothing,
    whether or not any output came (the line no longer waits for a request's output to be written)."""
    clock = Clock()
    stat_logger = LoggingStatLogger(interval=10.0, clock=clock, timer=False)
    caplog.set_level(logging.INFO, logger="pagedllm.metrics.loggers")
    clock.now = 105.0
    stat_logger.record(SchedulerStats(num_running_reqs=1), IterationStats(num_generation_tokens=50))
    stat_logger.record(SchedulerStats(num_running_reqs=0), IterationStats(num_generation_tokens=10))
    for now in (110.0, 120.0, 130.0):
        clock.now = now
        stat_logger.log()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "Avg generation throughput: 6.0 tokens/s, Running: 0 reqs" in lines[0]
    assert "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs" in lines[1]


def test_the_timer_logs_without_any_record(caplog):
    caplog.set_level(logging.INFO, logger="pagedllm.metrics.loggers")
    stat_logger = LoggingStatLogger(interval=0.05)
    stat_logger.record(SchedulerStats(num_running_reqs=2), None)
    deadline = time.monotonic() + 5
    while not caplog.records and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "Running: 2 reqs" in caplog.records[0].getMessage()


@pytest.mark.parametrize("value", ["nan", "-1", "ten", "inf"])
def test_a_bad_log_stats_interval_is_an_error_naming_the_variable(monkeypatch, value):
    """An interval that is no finite non-negative number fails when the server starts (a NaN killed the logging
    thread in silence); 0 stays every tick, as the server tests use it."""
    monkeypatch.setenv("PAGEDLLM_LOG_STATS_INTERVAL", value)
    with pytest.raises(ValueError, match="PAGEDLLM_LOG_STATS_INTERVAL"):
        log_stats_interval()
    monkeypatch.setenv("PAGEDLLM_LOG_STATS_INTERVAL", "0")
    assert log_stats_interval() == 0.0
    monkeypatch.delenv("PAGEDLLM_LOG_STATS_INTERVAL")
    assert log_stats_interval() == 10.0


def test_prompt_throughput_counts_computed_tokens_and_the_interval_shows_its_preemptions(caplog):
    """As vLLM's line: the prompt throughput is of the tokens computed (a prefix-cache hit costs nothing), and an
    interval with preemptions says how many, before the KV cache usage."""
    clock = Clock()
    stat_logger = LoggingStatLogger(interval=10.0, clock=clock, timer=False)
    caplog.set_level(logging.INFO, logger="pagedllm.metrics.loggers")
    stat_logger.record(SchedulerStats(num_preemptions=4), None)
    stat_logger.log()
    caplog.clear()
    clock.now = 110.0
    stat_logger.record(SchedulerStats(num_running_reqs=1, num_preemptions=7),
                       IterationStats(num_prompt_tokens=300, num_cached_prompt_tokens=200))
    stat_logger.log()
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("Engine 000: Avg prompt throughput: 10.0 tokens/s,")
    assert "Running: 1 reqs, Waiting: 0 reqs, Preemptions: 3, KV cache usage: 0.0%" in line


def test_the_prefix_cache_hit_rate_is_of_the_last_1000_requests_that_looked_it_up(caplog):
    """vLLM's CachingMetrics: an interval that admitted nothing still shows the recent hit rate (not 0), and the
    oldest steps leave the window once it holds more than 1000 requests."""
    clock = Clock()
    stat_logger = LoggingStatLogger(interval=10.0, clock=clock, timer=False)
    caplog.set_level(logging.INFO, logger="pagedllm.metrics.loggers")
    stat_logger.record(SchedulerStats(num_running_reqs=1, prefix_cache_requests=600, prefix_cache_queries=1000,
                                      prefix_cache_hits=1000), None)
    stat_logger.log()
    stat_logger.record(SchedulerStats(num_running_reqs=1, prefix_cache_requests=600, prefix_cache_queries=1000,
                                      prefix_cache_hits=1000), None)
    stat_logger.log()
    stat_logger.record(SchedulerStats(num_running_reqs=1, prefix_cache_requests=1200, prefix_cache_queries=2000,
                                      prefix_cache_hits=1000), None)
    stat_logger.log()
    rates = [r.getMessage().split("Prefix cache hit rate: ")[1] for r in caplog.records]
    assert rates == ["100.0%", "100.0%", "0.0%"]  # the first 600 requests left the window for the next 600


def test_the_prefix_cache_hit_rate_starts_afresh_after_a_reset(caplog):
    """vLLM's CachingMetrics.reset: once reset_prefix_cache has emptied the cache, the hit rate counts the requests
    after it only."""
    stat_logger = LoggingStatLogger(interval=10.0, clock=Clock(), timer=False)
    caplog.set_level(logging.INFO, logger="pagedllm.metrics.loggers")
    stat_logger.record(SchedulerStats(num_running_reqs=1, prefix_cache_requests=10, prefix_cache_queries=1000,
                                      prefix_cache_hits=900), None)
    stat_logger.log()
    stat_logger.record(SchedulerStats(num_running_reqs=1, prefix_cache_requests=11, prefix_cache_queries=1100,
                                      prefix_cache_hits=900, prefix_cache_resets=1), None)
    stat_logger.log()
    rates = [r.getMessage().split("Prefix cache hit rate: ")[1] for r in caplog.records]
    assert rates == ["90.0%", "0.0%"]


def test_the_offline_engine_logs_after_a_step_once_an_interval_has_passed(caplog):
    """LLM(disable_log_stats=False), as vLLM's do_log_stats_with_interval: no timer, the engine asks after each step
    with outputs, and the line comes once an interval has passed since the last."""
    clock = Clock()
    stat_logger = LoggingStatLogger(interval=10.0, clock=clock, timer=False)

    def log_when_due() -> None:  # LLMEngine.step's way
        if stat_logger.due():
            stat_logger.log()

    caplog.set_level(logging.INFO, logger="pagedllm.metrics.loggers")
    stat_logger.record(SchedulerStats(num_running_reqs=1), IterationStats(num_generation_tokens=5))
    clock.now = 109.0
    log_when_due()
    assert not caplog.records
    clock.now = 110.0
    log_when_due()
    log_when_due()
    [line] = [r.getMessage() for r in caplog.records]
    assert "Avg generation throughput: 0.5 tokens/s, Running: 1 reqs" in line
