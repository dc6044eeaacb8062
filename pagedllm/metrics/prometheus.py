"""PrometheusStatLogger: the engine's per-iteration stats as Prometheus metrics, vLLM's set under `pagedllm:`.

AsyncLLM calls record() from its output loop. The metrics live in the registry given (one per API server), not
prometheus_client's global one, so several servers can share a process (tests).
"""
from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedllm.engine.protocol import SchedulerStats
from pagedllm.metrics.stats import IterationStats

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        labels = {"model_name": model_name}

        def gauge(name: str, documentation: str):
            return Gauge(name, documentation, list(labels), registry=registry).labels(**labels)

        def counter(name: str, documentation: str):
            return Counter(name, documentation, list(labels), registry=registry).labels(**labels)

        def histogram(name: str, documentation: str, buckets: list[float]):
            return Histogram(name, documentation, list(labels), buckets=buckets, registry=registry).labels(**labels)

        self.gauge_num_requests_running = gauge("pagedllm:num_requests_running",
                                                "Number of requests in model execution batches.")
        self.gauge_num_requests_waiting = gauge("pagedllm:num_requests_waiting",
                                                "Number of requests waiting to be processed.")
        self.gauge_kv_cache_usage = gauge("pagedllm:kv_cache_usage_perc",
                                          "KV-cache usage. 1 means 100 percent usage.")
        self.counter_prefix_cache_queries = counter("pagedllm:prefix_cache_queries_total",
                                                    "Prefix cache queries, in terms of number of queried tokens.")
        self.counter_prefix_cache_hits = counter("pagedllm:prefix_cache_hits_total",
                                                 "Prefix cache hits, in terms of number of cached tokens.")
        self.counter_num_preemptions = counter("pagedllm:num_preemptions_total",
                                               "Cumulative number of preemptions from the engine.")
        self.counter_prompt_tokens = counter("pagedllm:prompt_tokens_total", "Number of prefill tokens processed.")
        self.counter_generation_tokens = counter("pagedllm:generation_tokens_total",
                                                 "Number of generation tokens processed.")
        self._labels = labels
        self.counter_request_success = Counter("pagedllm:request_success_total",
                                               "Count of successfully processed requests.",
                                               [*labels, "finished_reason"], registry=registry)
        for reason in FINISH_REASONS:  # exported as 0 from the start
            self.counter_request_success.labels(**labels, finished_reason=reason)
        self.histogram_time_to_first_token = histogram("pagedllm:time_to_first_token_seconds",
                                                       "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.histogram_inter_token_latency = histogram("pagedllm:inter_token_latency_seconds",
                                                       "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.histogram_e2e_request_latency = histogram("pagedllm:e2e_request_latency_seconds",
                                                       "Histogram of e2e request latency in seconds.",
                                                       _REQUEST_LATENCY_BUCKETS)
        self.histogram_request_queue_time = histogram("pagedllm:request_queue_time_seconds",
                                                      "Histogram of time spent in WAITING phase for request.",
                                                      _REQUEST_LATENCY_BUCKETS)
        # The engine reports cumulative totals; counters advance by the difference from the last report.
        self._last_scheduler_stats = SchedulerStats()

    def record(self, scheduler_stats: Optional[SchedulerStats], iteration_stats: Optional[IterationStats]) -> None:
        if scheduler_stats is not None:
            self._record_scheduler_stats(scheduler_stats)
        if iteration_stats is not None:
            self._record_iteration_stats(iteration_stats)

    def _record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.gauge_num_requests_running.set(stats.num_running_reqs)
        self.gauge_num_requests_waiting.set(stats.num_waiting_reqs)
        self.gauge_kv_cache_usage.set(stats.kv_cache_usage)
        last = self._last_scheduler_stats
        self.counter_prefix_cache_queries.inc(max(stats.prefix_cache_queries - last.prefix_cache_queries, 0))
        self.counter_prefix_cache_hits.inc(max(stats.prefix_cache_hits - last.prefix_cache_hits, 0))
        self.counter_num_preemptions.inc(max(stats.num_preemptions - last.num_preemptions, 0))
        self._last_scheduler_stats = stats

    def _record_iteration_stats(self, stats: IterationStats) -> None:
        self.counter_prompt_tokens.inc(stats.num_prompt_tokens)
        self.counter_generation_tokens.inc(stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens_iter:
            self.histogram_time_to_first_token.observe(ttft)
        for itl in stats.inter_token_latencies_iter:
            self.histogram_inter_token_latency.observe(itl)
        for finished in stats.finished_requests:
            self.counter_request_success.labels(**self._labels, finished_reason=finished.finish_reason).inc()
            self.histogram_e2e_request_latency.observe(finished.e2e_latency)
            self.histogram_request_queue_time.observe(finished.queued_time)
