"""PrometheusStatLogger: the engine's per-iteration stats as Prometheus metrics, vLLM's set under `pagedllm:`.

AsyncLLM calls record() from its output loop. The metrics live in the registry given (one per API server), not
prometheus_client's global one, so several servers can share a process (tests). Every metric carries vLLM's
`engine` label: the data-parallel engine whose step it describes ("0" with one engine).
"""
from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedllm.config import parse_memory_size
from pagedllm.engine.protocol import SchedulerStats
from pagedllm.metrics.stats import FinishedRequestStats, IterationStats

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_REQUEST_PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
_REQUEST_NUM_PREEMPTIONS_BUCKETS = [1, 2, 3, 4, 5, 10, 20]
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values that pagedllm gives
# vLLM's histograms of a finished request: (name, documentation, bucket kind, the figure observed).
_FINISHED_REQUEST_HISTOGRAMS: list[tuple[str, str, str, Callable[[FinishedRequestStats], float]]] = [
    ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "latency",
     lambda f: f.e2e_latency),
    ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", "latency",
     lambda f: f.queued_time),
    ("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", "latency",
     lambda f: f.inference_time),
    ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", "latency",
     lambda f: f.prefill_time),
    ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", "latency",
     lambda f: f.decode_time),
    ("request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.", "itl",
     lambda f: f.mean_time_per_output_token),
    ("request_num_preemptions", "Histogram of the number of times a request was preempted.", "preemptions",
     lambda f: f.num_preemptions),
    ("request_prompt_tokens", "Number of prefill tokens processed.", "tokens", lambda f: f.num_prompt_tokens),
    ("request_generation_tokens", "Number of generation tokens processed.", "tokens",
     lambda f: f.num_generation_tokens),
    ("request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens).", "tokens",
     lambda f: f.num_prompt_tokens - max(f.num_cached_tokens, 0)),
]


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's buckets for per-request token counts: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def unregister_pagedllm_metrics(registry: CollectorRegistry) -> None:
    """Takes the pagedllm: metrics out of ``registry`` (vLLM's unregister_vllm_metrics), so that an engine made after
    another in the same process can register its own in prometheus_client's default registry."""
    for collector, names in list(registry._collector_to_names.items()):
        if any(name.startswith("pagedllm:") for name in names):
            registry.unregister(collector)


def cache_config_info(cache_config) -> dict[str, str]:
    """The KV cache's settings under vLLM's CacheConfig names, as strings (vLLM's metrics_info), for
    cache_config_info: num_gpu_blocks is the engine's once its cache is sized (the ready response says it), every
    engine's together with data parallelism (vLLM's sum)."""
    memory = cache_config.kv_cache_memory
    return {"block_size": str(cache_config.block_size), "cache_dtype": cache_config.cache_dtype,
            "enable_prefix_caching": str(cache_config.enable_prefix_caching),
            "gpu_memory_utilization": str(cache_config.gpu_memory_utilization),
            "kv_cache_memory_bytes": str(None if memory is None else parse_memory_size(memory)),
            "num_gpu_blocks": str(cache_config.num_blocks), "sliding_window": str(cache_config.sliding_window)}


class PrometheusStatLogger:
    @classmethod
    def from_config(cls, model_name: str, registry: CollectorRegistry, config) -> "PrometheusStatLogger":
        """The metrics of the engine(s) ``config`` (an EngineConfig) describes: its data-parallel engines, draft
        positions and LoRA slots."""
        spec = config.speculative_config
        num_engines = config.parallel_config.data_parallel_size
        stat_logger = cls(model_name, registry, config.model_config.max_model_len, num_engines,
                          spec.num_speculative_tokens if spec is not None else 0,
                          config.lora_config.max_loras if config.lora_config is not None else 0)
        # vLLM's info metric: a gauge set to 1, its labels the settings (Info does not survive multiprocess mode).
        info = cache_config_info(config.cache_config)
        gauge = Gauge("pagedllm:cache_config_info", "Information of the LLMEngine CacheConfig", [*info, "engine"],
                      registry=registry)
        for engine in range(num_engines):
            gauge.labels(**info, engine=str(engine)).set(1)
        return stat_logger

    def __init__(self, model_name: str, registry: CollectorRegistry, max_model_len: int, num_engines: int = 1,
                 num_speculative_tokens: int = 0, max_loras: int = 0) -> None:
        """``max_model_len`` bounds the per-request token histograms' buckets; ``max_loras``: the engine's, with
        LoRA enabled (0: off, no lora_requests_info)."""
        label_names = ["model_name", "engine"]
        self._model_name = model_name

        def per_engine(metric) -> list:
            return [metric.labels(model_name=model_name, engine=str(i)) for i in range(num_engines)]

        def gauge(name: str, documentation: str):
            return per_engine(Gauge(name, documentation, label_names, registry=registry))

        def counter(name: str, documentation: str):
            return per_engine(Counter(name, documentation, label_names, registry=registry))

        def histogram(name: str, documentation: str, buckets: list[float]):
            return per_engine(Histogram(name, documentation, label_names, buckets=buckets, registry=registry))

        self.gauge_num_requests_running = gauge("pagedllm:num_requests_running",
                                                "Number of requests in model execution batches.")
        self.gauge_num_requests_waiting = gauge("pagedllm:num_requests_waiting",
                                                "Number of requests waiting to be processed.")
        by_reason = Gauge("pagedllm:num_requests_waiting_by_reason",
                          "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
                          "capacity; 'deferred' = deferred by transient constraints (LoRA budget, a structured "
                          "output grammar compiling). Sum of all reasons equals pagedllm:num_requests_waiting.",
                          [*label_names, "reason"], registry=registry)
        self.gauge_num_requests_waiting_by_reason = {
            reason: [by_reason.labels(model_name, str(engine), reason) for engine in range(num_engines)]
            for reason in ("capacity", "deferred")}
        self.gauge_kv_cache_usage = gauge("pagedllm:kv_cache_usage_perc",
                                          "KV-cache usage. 1 means 100 percent usage.")
        self.counter_prefix_cache_queries = counter("pagedllm:prefix_cache_queries_total",
                                                    "Prefix cache queries, in terms of number of queried tokens.")
        self.counter_prefix_cache_hits = counter("pagedllm:prefix_cache_hits_total",
                                                 "Prefix cache hits, in terms of number of cached tokens.")
        self.counter_num_preemptions = counter("pagedllm:num_preemptions_total",
                                               "Cumulative number of preemptions from the engine.")
        self.counter_spec_decode_num_drafts = counter("pagedllm:spec_decode_num_drafts",
                                                      "Number of spec decoding drafts.")
        self.counter_spec_decode_num_draft_tokens = counter("pagedllm:spec_decode_num_draft_tokens",
                                                            "Number of draft tokens.")
        self.counter_spec_decode_num_accepted_tokens = counter("pagedllm:spec_decode_num_accepted_tokens",
                                                               "Number of accepted tokens.")
        per_pos = Counter("pagedllm:spec_decode_num_accepted_tokens_per_pos",
                          "Accepted tokens per draft position.", [*label_names, "position"], registry=registry)
        self.counter_spec_decode_num_accepted_tokens_per_pos = [
            [per_pos.labels(model_name, str(engine), str(pos)) for pos in range(num_speculative_tokens)]
            for engine in range(num_engines)]
        self.counter_prompt_tokens = counter("pagedllm:prompt_tokens_total", "Number of prefill tokens processed.")
        self.counter_generation_tokens = counter("pagedllm:generation_tokens_total",
                                                 "Number of generation tokens processed.")
        self.counter_request_success = Counter("pagedllm:request_success_total",
                                               "Count of successfully processed requests.",
                                               [*label_names, "finished_reason"], registry=registry)
        for engine in range(num_engines):
            for reason in FINISH_REASONS:  # exported as 0 from the start
                self.counter_request_success.labels(model_name, str(engine), reason)
        self.histogram_time_to_first_token = histogram("pagedllm:time_to_first_token_seconds",
                                                       "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.histogram_inter_token_latency = histogram("pagedllm:inter_token_latency_seconds",
                                                       "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        buckets = {"latency": _REQUEST_LATENCY_BUCKETS, "itl": _ITL_BUCKETS,
                   "preemptions": _REQUEST_NUM_PREEMPTIONS_BUCKETS, "tokens": request_tokens_buckets(max_model_len)}
        self.finished_request_histograms = [(histogram(f"pagedllm:{name}", documentation, buckets[kind]), figure)
                                            for name, documentation, kind, figure in _FINISHED_REQUEST_HISTOGRAMS]
        self.histogram_request_params_max_tokens = histogram("pagedllm:request_params_max_tokens",
                                                             "Histogram of the max_tokens request parameter.",
                                                             buckets["tokens"])
        self.histogram_request_max_num_generation_tokens = histogram(
            "pagedllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", buckets["tokens"])
        self.histogram_request_params_n = histogram("pagedllm:request_params_n",
                                                    "Histogram of the n request parameter.",
                                                    _REQUEST_PARAMS_N_BUCKETS)
        self.histogram_iteration_tokens = histogram("pagedllm:iteration_tokens_total",
                                                    "Histogram of number of tokens per engine_step.",
                                                    _ITERATION_TOKENS_BUCKETS)
        self.counter_prompt_tokens_cached = counter("pagedllm:prompt_tokens_cached",
                                                    "Number of cached prompt tokens (local + external).")
        # The engine reports cumulative totals; counters advance by the difference from the last report.
        self._last_scheduler_stats = [SchedulerStats() for _ in range(num_engines)]
        # vLLM's: one series per (max_lora, waiting, running) combination, set to the time it was last seen; the
        # adapters as comma-separated names (over all data-parallel engines).
        self._max_loras = max_loras
        self.gauge_lora_info = Gauge("pagedllm:lora_requests_info", "Running stats on lora requests.",
                                     ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                     registry=registry) if max_loras else None

    def record(self, scheduler_stats: Optional[SchedulerStats], iteration_stats: Optional[IterationStats],
               engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self._record_scheduler_stats(scheduler_stats, engine_idx)
        if iteration_stats is not None:
            self._record_iteration_stats(iteration_stats, engine_idx)

    def _record_scheduler_stats(self, stats: SchedulerStats, engine: int) -> None:
        self.gauge_num_requests_running[engine].set(stats.num_running_reqs)
        self.gauge_num_requests_waiting[engine].set(stats.num_waiting_reqs + stats.num_skipped_waiting_reqs)
        self.gauge_num_requests_waiting_by_reason["capacity"][engine].set(stats.num_waiting_reqs)
        self.gauge_num_requests_waiting_by_reason["deferred"][engine].set(stats.num_skipped_waiting_reqs)
        self.gauge_kv_cache_usage[engine].set(stats.kv_cache_usage)
        last = self._last_scheduler_stats[engine]
        self.counter_prefix_cache_queries[engine].inc(max(stats.prefix_cache_queries - last.prefix_cache_queries, 0))
        self.counter_prefix_cache_hits[engine].inc(max(stats.prefix_cache_hits - last.prefix_cache_hits, 0))
        self.counter_num_preemptions[engine].inc(max(stats.num_preemptions - last.num_preemptions, 0))
        for counter, now, before in (
                (self.counter_spec_decode_num_drafts, stats.spec_decode_num_drafts, last.spec_decode_num_drafts),
                (self.counter_spec_decode_num_draft_tokens, stats.spec_decode_num_draft_tokens,
                 last.spec_decode_num_draft_tokens),
                (self.counter_spec_decode_num_accepted_tokens, stats.spec_decode_num_accepted_tokens,
                 last.spec_decode_num_accepted_tokens)):
            counter[engine].inc(max(now - before, 0))
        last_per_pos = last.spec_decode_num_accepted_tokens_per_pos
        for pos, (counter, now) in enumerate(zip(self.counter_spec_decode_num_accepted_tokens_per_pos[engine],
                                                 stats.spec_decode_num_accepted_tokens_per_pos)):
            counter.inc(max(now - (last_per_pos[pos] if pos < len(last_per_pos) else 0), 0))
        self._last_scheduler_stats[engine] = stats
        if self.gauge_lora_info is not None:
            self.gauge_lora_info.labels(
                max_lora=str(self._max_loras),
                waiting_lora_adapters=",".join(sorted({a for s in self._last_scheduler_stats
                                                       for a in s.waiting_lora_adapters})),
                running_lora_adapters=",".join(sorted({a for s in self._last_scheduler_stats
                                                       for a in s.running_lora_adapters}))).set_to_current_time()

    def _record_iteration_stats(self, stats: IterationStats, engine: int) -> None:
        self.counter_prompt_tokens[engine].inc(stats.num_prompt_tokens)
        self.counter_prompt_tokens_cached[engine].inc(stats.num_cached_prompt_tokens)
        self.counter_generation_tokens[engine].inc(stats.num_generation_tokens)
        # vLLM's: the prompt tokens computed (not cached) of prefills that completed, and the tokens generated
        self.histogram_iteration_tokens[engine].observe(
            stats.num_prompt_tokens - stats.num_cached_prompt_tokens + stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens_iter:
            self.histogram_time_to_first_token[engine].observe(ttft)
        for itl in stats.inter_token_latencies_iter:
            self.histogram_inter_token_latency[engine].observe(itl)
        for n in stats.n_params_iter:
            self.histogram_request_params_n[engine].observe(n)
        for num_tokens in stats.max_num_generation_tokens_iter:
            self.histogram_request_max_num_generation_tokens[engine].observe(num_tokens)
        for finished in stats.finished_requests:
            self._record_finished(finished, engine)

    def _record_finished(self, finished: FinishedRequestStats, engine: int) -> None:
        self.counter_request_success.labels(self._model_name, str(engine), finished.finish_reason).inc()
        for histogram, figure in self.finished_request_histograms:
            histogram[engine].observe(figure(finished))
        if finished.max_tokens_param:
            self.histogram_request_params_max_tokens[engine].observe(finished.max_tokens_param)
