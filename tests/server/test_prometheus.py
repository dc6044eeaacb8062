"""PrometheusStatLogger on its own: cumulative engine totals become counters, and each server's registry is
its own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from pagedllm.engine.protocol import SchedulerStats
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.stats import FinishedRequestStats, IterationStats

REQUIRED = ["pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc",
            "pagedllm:prefix_cache_queries_total", "pagedllm:prefix_cache_hits_total",
            "pagedllm:prompt_tokens_total", "pagedllm:generation_tokens_total", "pagedllm:num_preemptions_total",
            "pagedllm:request_success_total", "pagedllm:time_to_first_token_seconds_count",
            "pagedllm:inter_token_latency_seconds_count", "pagedllm:e2e_request_latency_seconds_count",
            "pagedllm:request_queue_time_seconds_count"]


def value(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})


def test_cumulative_engine_totals_become_counters():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry)
    logger.record(SchedulerStats(num_running_reqs=3, kv_cache_usage=0.5, prefix_cache_queries=100,
                                 prefix_cache_hits=40, num_preemptions=1), None)
    logger.record(SchedulerStats(num_running_reqs=1, num_waiting_reqs=2, kv_cache_usage=0.25,
                                 prefix_cache_queries=150, prefix_cache_hits=40, num_preemptions=3), None)
    assert value(registry, "pagedllm:num_requests_running") == 1
    assert value(registry, "pagedllm:num_requests_waiting") == 2
    assert value(registry, "pagedllm:kv_cache_usage_perc") == 0.25
    assert value(registry, "pagedllm:prefix_cache_queries_total") == 150
    assert value(registry, "pagedllm:prefix_cache_hits_total") == 40
    assert value(registry, "pagedllm:num_preemptions_total") == 3


def test_iteration_stats():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry)
    logger.record(None, IterationStats(
        num_prompt_tokens=10, num_generation_tokens=4, time_to_first_tokens_iter=[0.2, 0.3],
        inter_token_latencies_iter=[0.05, 0.05],
        finished_requests=[FinishedRequestStats("stop", 1.5, 0.1, 5, 7), FinishedRequestStats("abort", 2, 0, 5, 1)]))
    assert value(registry, "pagedllm:prompt_tokens_total") == 10
    assert value(registry, "pagedllm:generation_tokens_total") == 4
    assert value(registry, "pagedllm:time_to_first_token_seconds_count") == 2
    assert value(registry, "pagedllm:inter_token_latency_seconds_count") == 2
    assert value(registry, "pagedllm:e2e_request_latency_seconds_sum") == 3.5
    assert value(registry, "pagedllm:request_queue_time_seconds_count") == 2
    assert value(registry, "pagedllm:request_success_total", finished_reason="stop") == 1
    assert value(registry, "pagedllm:request_success_total", finished_reason="abort") == 1
    assert value(registry, "pagedllm:request_success_total", finished_reason="length") == 0


def test_each_registry_is_independent():
    """Two servers in one process (tests) each get every metric, starting from zero."""
    first, second = CollectorRegistry(), CollectorRegistry()
    PrometheusStatLogger("m", first).record(None, IterationStats(num_prompt_tokens=5))
    PrometheusStatLogger("m", second)
    assert value(first, "pagedllm:prompt_tokens_total") == 5
    assert value(second, "pagedllm:prompt_tokens_total") == 0


def test_server_exports_every_metric(server):
    text = server.metrics()
    for name in REQUIRED:
        assert any(key == name or key.startswith(name + "{") for key in text), name


def test_each_data_parallel_engine_has_its_own_series():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry, num_engines=2)
    logger.record(SchedulerStats(num_running_reqs=3, prefix_cache_queries=100), None, engine=0)
    logger.record(SchedulerStats(num_running_reqs=1, prefix_cache_queries=30), None, engine=1)
    logger.record(SchedulerStats(num_running_reqs=2, prefix_cache_queries=50), None, engine=1)
    assert value(registry, "pagedllm:num_requests_running", engine="0") == 3
    assert value(registry, "pagedllm:num_requests_running", engine="1") == 2
    assert value(registry, "pagedllm:prefix_cache_queries_total", engine="0") == 100
    assert value(registry, "pagedllm:prefix_cache_queries_total", engine="1") == 50
