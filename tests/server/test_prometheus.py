"""PrometheusStatLogger on its own: cumulative engine totals become counters, and each server's registry is
its own."""
from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.engine.protocol import SchedulerStats
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.prometheus import request_tokens_buckets
from pagedllm.metrics.stats import FinishedRequestStats, IterationStats
from tests.server.test_load import wait_until_idle

MAX_MODEL_LEN = 2048

REQUIRED = ["pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc",
            "pagedllm:prefix_cache_queries_total", "pagedllm:prefix_cache_hits_total",
            "pagedllm:prompt_tokens_total", "pagedllm:generation_tokens_total", "pagedllm:num_preemptions_total",
            "pagedllm:request_success_total", "pagedllm:time_to_first_token_seconds_count",
            "pagedllm:inter_token_latency_seconds_count", "pagedllm:e2e_request_latency_seconds_count",
            "pagedllm:request_queue_time_seconds_count", "pagedllm:request_inference_time_seconds_count",
            "pagedllm:request_prefill_time_seconds_count", "pagedllm:request_decode_time_seconds_count",
            "pagedllm:request_time_per_output_token_seconds_count", "pagedllm:request_num_preemptions_count",
            "pagedllm:request_prompt_tokens_count", "pagedllm:request_generation_tokens_count",
            "pagedllm:request_prefill_kv_computed_tokens_count", "pagedllm:request_params_max_tokens_count",
            "pagedllm:request_max_num_generation_tokens_count", "pagedllm:request_params_n_count",
            "pagedllm:iteration_tokens_total_count", "pagedllm:prompt_tokens_cached_total",
            "pagedllm:num_requests_waiting_by_reason"]


def value(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})


def test_cumulative_engine_totals_become_counters():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry, MAX_MODEL_LEN)
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


def test_waiting_requests_by_reason():
    """vLLM's: num_requests_waiting counts every waiting request, num_requests_waiting_by_reason splits them into
    those waiting for the step's capacity and those deferred (a grammar compiling, no LoRA slot free)."""
    registry = CollectorRegistry()
    PrometheusStatLogger("m", registry, MAX_MODEL_LEN).record(
        SchedulerStats(num_waiting_reqs=2, num_skipped_waiting_reqs=3), None)
    assert value(registry, "pagedllm:num_requests_waiting") == 5
    assert value(registry, "pagedllm:num_requests_waiting_by_reason", reason="capacity") == 2
    assert value(registry, "pagedllm:num_requests_waiting_by_reason", reason="deferred") == 3


def test_iteration_stats():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry, MAX_MODEL_LEN)
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


def test_finished_request_histograms():
    """Each finished request's phases, counts and parameters land in vLLM's per-request histograms; the token
    histograms' buckets run 1, 2, 5, 10, ... up to max_model_len."""
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry, MAX_MODEL_LEN)
    logger.record(None, IterationStats(
        num_prompt_tokens=30, num_cached_prompt_tokens=16, num_generation_tokens=3, n_params_iter=[2],
        max_num_generation_tokens_iter=[9],
        finished_requests=[FinishedRequestStats("length", 1.5, 0.1, 30, 9, prefill_time=0.2, decode_time=0.8,
                                                inference_time=1.0, mean_time_per_output_token=0.1,
                                                num_preemptions=3, num_cached_tokens=16, max_tokens_param=9)]))
    for name, observed in (("request_prefill_time_seconds", 0.2), ("request_decode_time_seconds", 0.8),
                           ("request_inference_time_seconds", 1.0),
                           ("request_time_per_output_token_seconds", 0.1), ("request_num_preemptions", 3),
                           ("request_prompt_tokens", 30), ("request_generation_tokens", 9),
                           ("request_prefill_kv_computed_tokens", 14), ("request_params_max_tokens", 9),
                           ("request_max_num_generation_tokens", 9), ("request_params_n", 2),
                           ("iteration_tokens_total", 30 - 16 + 3)):
        assert value(registry, f"pagedllm:{name}_count") == 1, name
        assert value(registry, f"pagedllm:{name}_sum") == observed, name
    assert value(registry, "pagedllm:prompt_tokens_cached_total") == 16
    assert value(registry, "pagedllm:request_num_preemptions_bucket", le="2.0") == 0
    assert value(registry, "pagedllm:request_num_preemptions_bucket", le="3.0") == 1
    assert value(registry, "pagedllm:request_prompt_tokens_bucket", le="20.0") == 0
    assert value(registry, "pagedllm:request_prompt_tokens_bucket", le="50.0") == 1
    assert request_tokens_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert request_tokens_buckets(MAX_MODEL_LEN)[-1] == 2000


def test_each_registry_is_independent():
    """Two servers in one process (tests) each get every metric, starting from zero."""
    first, second = CollectorRegistry(), CollectorRegistry()
    PrometheusStatLogger("m", first, MAX_MODEL_LEN).record(None, IterationStats(num_prompt_tokens=5))
    PrometheusStatLogger("m", second, MAX_MODEL_LEN)
    assert value(first, "pagedllm:prompt_tokens_total") == 5
    assert value(second, "pagedllm:prompt_tokens_total") == 0


def test_server_exports_every_metric(server):
    text = server.metrics()
    for name in REQUIRED:
        assert any(key == name or key.startswith(name + "{") for key in text), name


def test_the_kv_caches_settings_are_an_info_gauge(server):
    """vLLM's cache_config_info: one series set to 1, labelled with the cache's settings, its blocks the engine's
    (which its ready response told the API process)."""
    text = httpx.get(server.url_for("metrics"), timeout=10).text
    (labels,) = [sample.labels for family in text_string_to_metric_families(text) for sample in family.samples
                 if sample.name == "pagedllm:cache_config_info" and sample.value == 1]
    assert (labels["block_size"], labels["cache_dtype"], labels["enable_prefix_caching"], labels["engine"]) == (
        "16", "auto", "True", "0")
    assert labels["kv_cache_memory_bytes"] == str(256 << 20)
    assert int(labels["num_gpu_blocks"]) == (256 << 20) // (2 * 30 * 3 * 64 * 16 * 4)  # SmolLM2's float32 blocks


def test_server_exports_the_process_and_python_metrics(server):
    """As vLLM's /metrics (prometheus_client's default registry): the process's and Python's metrics too."""
    text = server.metrics()
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "python_info",
                 "python_gc_objects_collected_total"):
        assert any(key == name or key.startswith(name + "{") for key in text), name


def test_a_request_with_n_lands_in_the_per_request_histograms(server):
    """One completion with n = 2 through the server: two finished sequences in the per-request histograms, one
    user request in request_params_n (the series advance by exactly this request's figures once it is done)."""
    before = wait_until_idle(server, 0.0)
    client = server.get_client()
    completion = client.completions.create(model="smollm2-135m-instruct", prompt="Once upon a time", n=2,
                                           max_tokens=6, temperature=0.8, seed=3, extra_body={"ignore_eos": True})
    assert [len(choice.text) > 0 for choice in completion.choices] == [True, True]
    after = wait_until_idle(server, 0.0)

    def advanced(name: str) -> float:
        return after[f"pagedllm:{name}"] - before[f"pagedllm:{name}"]

    assert advanced("request_params_n_count") == 1 and advanced("request_params_n_sum") == 2
    assert advanced("request_max_num_generation_tokens_sum") == 6
    assert advanced("request_generation_tokens_count") == 2 and advanced("request_generation_tokens_sum") == 12
    assert advanced("request_params_max_tokens_sum") == 12
    prompt_tokens = completion.usage.prompt_tokens
    assert advanced("request_prompt_tokens_sum") == 2 * prompt_tokens
    for phase in ("prefill", "decode", "inference"):
        assert advanced(f"request_{phase}_time_seconds_count") == 2
    assert advanced("request_decode_time_seconds_sum") > 0
    assert advanced("request_time_per_output_token_seconds_count") == 2


def test_each_data_parallel_engine_has_its_own_series():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry, MAX_MODEL_LEN, num_engines=2)
    logger.record(SchedulerStats(num_running_reqs=3, prefix_cache_queries=100), None, engine_idx=0)
    logger.record(SchedulerStats(num_running_reqs=1, prefix_cache_queries=30), None, engine_idx=1)
    logger.record(SchedulerStats(num_running_reqs=2, prefix_cache_queries=50), None, engine_idx=1)
    assert value(registry, "pagedllm:num_requests_running", engine="0") == 3
    assert value(registry, "pagedllm:num_requests_running", engine="1") == 2
    assert value(registry, "pagedllm:prefix_cache_queries_total", engine="0") == 100
    assert value(registry, "pagedllm:prefix_cache_queries_total", engine="1") == 50


def test_the_snapshot_reader_gives_each_series_as_an_object():
    """LLM.get_metrics()'s reader (vLLM's get_metrics_snapshot): a counter under its family's name (no `_total`),
    a histogram with its buckets by upper limit, the per-position counter of accepted drafts as one Vector per
    engine."""
    from pagedllm.metrics.reader import Counter, Gauge, Histogram, Vector, get_metrics_snapshot

    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry, MAX_MODEL_LEN, num_engines=2, num_speculative_tokens=3)
    logger.record(SchedulerStats(num_running_reqs=2, spec_decode_num_accepted_tokens_per_pos=[5, 3, 1]), None,
                  engine_idx=1)
    logger.record(None, IterationStats(num_generation_tokens=7, time_to_first_tokens_iter=[0.003, 0.3]), engine_idx=1)
    snapshot = get_metrics_snapshot(registry)
    assert all(m.name.startswith("pagedllm:") for m in snapshot)

    def find(name: str, engine: str):
        [metric] = [m for m in snapshot if m.name == name and m.labels.get("engine") == engine]
        return metric

    assert find("pagedllm:generation_tokens", "1") == Counter("pagedllm:generation_tokens",
                                                             {"model_name": "m", "engine": "1"}, 7)
    assert find("pagedllm:num_requests_running", "1") == Gauge("pagedllm:num_requests_running",
                                                              {"model_name": "m", "engine": "1"}, 2.0)
    ttft = find("pagedllm:time_to_first_token_seconds", "1")
    assert isinstance(ttft, Histogram) and (ttft.count, ttft.sum) == (2, 0.303)
    assert (ttft.buckets["0.001"], ttft.buckets["0.005"], ttft.buckets["0.25"], ttft.buckets["+Inf"]) == (0, 1, 1, 2)
    assert find("pagedllm:spec_decode_num_accepted_tokens_per_pos", "1") == Vector(
        "pagedllm:spec_decode_num_accepted_tokens_per_pos", {"model_name": "m", "engine": "1"}, [5, 3, 1])
    assert find("pagedllm:spec_decode_num_accepted_tokens_per_pos", "0").values == [0, 0, 0]
