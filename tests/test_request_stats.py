"""The frontend's per-request statistics (OutputProcessor): each request's phases split as vLLM splits them, its
preemptions and cached prompt tokens as the engine reports them, and an n > 1 request's n and longest sequence
once its last sequence finishes."""
from __future__ import annotations

import types

from prometheus_client import CollectorRegistry

from pagedllm.engine import output_processor
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.parallel_sampling import fan_out
from pagedllm.engine.protocol import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason,
                                      SchedulerStats)
from pagedllm.metrics.logger_factories import aggregate, make_stat_loggers
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.stats import IterationStats, RequestStateStats
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


def step(processor: OutputProcessor, clock: Clock, now: float, *outputs: EngineCoreOutput) -> IterationStats:
    clock.now = now
    stats = IterationStats()
    processor.process_outputs(list(outputs), stats)
    return stats


def test_phases_preemptions_and_cached_tokens(monkeypatch):
    clock = Clock(100.0)
    monkeypatch.setattr(output_processor, "time", clock)
    processor = OutputProcessor(tokenizer=None, log_stats=True)
    params = SamplingParams(max_tokens=4, detokenize=False, output_kind=RequestOutputKind.DELTA)
    processor.add_requests([EngineCoreRequest("r", list(range(10)), params, None, 100.0)], None)
    first = step(processor, clock, 101.0, EngineCoreOutput("r", [5], num_cached_tokens=8,
                                                           first_scheduled_time=100.5))
    assert (first.num_prompt_tokens, first.num_cached_prompt_tokens, first.time_to_first_tokens_iter) == (
        10, 8, [1.0])
    step(processor, clock, 101.5, EngineCoreOutput("r", [6], num_cached_tokens=8, num_preemptions=1))
    last = step(processor, clock, 103.0, EngineCoreOutput("r", [7, 8], finish_reason=FinishReason.LENGTH,
                                                          num_cached_tokens=8, num_preemptions=2))
    [finished] = last.finished_requests
    assert (finished.e2e_latency, finished.queued_time, finished.prefill_time, finished.decode_time,
            finished.inference_time) == (3.0, 0.5, 0.5, 2.0, 2.5)
    assert finished.mean_time_per_output_token == 2.0 / 3  # decode time over the 3 tokens after the first
    assert (finished.num_generation_tokens, finished.num_preemptions, finished.num_cached_tokens,
            finished.max_tokens_param) == (4, 2, 8, 4)
    assert (last.n_params_iter, last.max_num_generation_tokens_iter) == ([1], [4])


def test_a_request_that_generated_nothing_has_no_prefill_or_decode_phase(monkeypatch):
    clock = Clock(10.0)
    monkeypatch.setattr(output_processor, "time", clock)
    processor = OutputProcessor(tokenizer=None, log_stats=True)
    params = SamplingParams(detokenize=False, output_kind=RequestOutputKind.DELTA)
    processor.add_requests([EngineCoreRequest("r", [1, 2], params, None, 10.0)], None)
    stats = step(processor, clock, 12.0, EngineCoreOutput("r", [], finish_reason=FinishReason.ABORT,
                                                          first_scheduled_time=11.0))
    [finished] = stats.finished_requests
    assert (finished.queued_time, finished.prefill_time, finished.decode_time, finished.inference_time,
            finished.mean_time_per_output_token) == (1.0, 0.0, 0.0, 0.0, 0.0)


def test_parallel_sampling_reports_n_and_the_longest_sequence_once(monkeypatch):
    clock = Clock(0.0)
    monkeypatch.setattr(output_processor, "time", clock)
    processor = OutputProcessor(tokenizer=None, log_stats=True)
    params = SamplingParams(n=3, max_tokens=5, seed=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
    parent, children = fan_out(EngineCoreRequest("p", [1, 2, 3], params, None, 0.0))
    processor.add_requests(children, None, parent)
    first, second, third = (child.request_id for child in children)
    stats = step(processor, clock, 1.0, EngineCoreOutput(first, [4, 5, 6], finish_reason=FinishReason.STOP),
                 EngineCoreOutput(second, [4]), EngineCoreOutput(third, [7]))
    assert stats.n_params_iter == [] and len(stats.finished_requests) == 1
    stats = step(processor, clock, 2.0, EngineCoreOutput(second, [5, 6, 7, 8], finish_reason=FinishReason.LENGTH))
    assert stats.n_params_iter == []
    stats = step(processor, clock, 3.0, EngineCoreOutput(third, [8], finish_reason=FinishReason.STOP))
    assert (stats.n_params_iter, stats.max_num_generation_tokens_iter) == ([3], [5])


def test_a_batch_without_request_outputs_is_no_iteration():
    """As vLLM's: a batch from the engine core that holds no request output (a chunked prefill's step, the idle report
    after an abort) sets the gauges but observes nothing in iteration_tokens_total, whose count is the steps that
    gave tokens."""
    registry = CollectorRegistry()
    processor = OutputProcessor(tokenizer=None, log_stats=True)
    params = SamplingParams(detokenize=False, output_kind=RequestOutputKind.DELTA)
    processor.add_requests([EngineCoreRequest("r", [1, 2], params, None, 0.0)], None)
    stat_loggers = [PrometheusStatLogger("m", registry, 2048)]
    processor.process_engine_outputs(EngineCoreOutputs(scheduler_stats=SchedulerStats(num_running_reqs=1)),
                                     stat_loggers)
    processor.process_engine_outputs(EngineCoreOutputs([EngineCoreOutput("r", [3])], SchedulerStats()),
                                     stat_loggers)
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("pagedllm:iteration_tokens_total_count", labels) == 1
    assert registry.get_sample_value("pagedllm:iteration_tokens_total_sum", labels) == 3


def test_a_request_that_ended_with_an_error_counts_under_error(monkeypatch):
    """Refused by the engine (its finish reason "length") or stopped by its grammar ("stop"), a request with an error
    is no success: request_success counts it under finished_reason="error", as vLLM's FINISHED_ERROR ones."""
    registry = CollectorRegistry()
    processor = OutputProcessor(tokenizer=None, log_stats=True)
    params = SamplingParams(detokenize=False, output_kind=RequestOutputKind.DELTA)
    for request_id in ("refused", "grammar", "fine"):
        processor.add_requests([EngineCoreRequest(request_id, [1, 2], params, None, 0.0)], None)
    processor.process_engine_outputs(EngineCoreOutputs([
        EngineCoreOutput("refused", [], finish_reason=FinishReason.LENGTH, error="The prompt is empty."),
        EngineCoreOutput("grammar", [3], finish_reason=FinishReason.STOP, error="The sampled token 3 does not ..."),
        EngineCoreOutput("fine", [3], finish_reason=FinishReason.STOP)]), [PrometheusStatLogger("m", registry, 2048)])

    def count(reason: str) -> float:
        return registry.get_sample_value("pagedllm:request_success_total",
                                         {"model_name": "m", "engine": "0", "finished_reason": reason})

    assert (count("error"), count("stop"), count("length")) == (2, 1, 0)


def test_request_outputs_carry_their_metrics_with_stat_logging_only(monkeypatch):
    """vLLM's RequestOutput.metrics: the request's RequestStateStats with stat logging on, None with it off."""
    clock = Clock(10.0)
    monkeypatch.setattr(output_processor, "time", clock)
    params = SamplingParams(detokenize=False, output_kind=RequestOutputKind.DELTA)
    quiet, logged = OutputProcessor(tokenizer=None), OutputProcessor(tokenizer=None, log_stats=True)
    for processor in (quiet, logged):
        processor.add_requests([EngineCoreRequest("r", [1, 2], params, None, 10.0)], None)
    [output] = quiet.process_outputs([EngineCoreOutput("r", [3])]).request_outputs
    assert output.metrics is None
    step(logged, clock, 11.0, EngineCoreOutput("r", [3], first_scheduled_time=10.5))
    [output] = logged.process_outputs([EngineCoreOutput("r", [4, 5], num_preemptions=1)], IterationStats()
                                      ).request_outputs
    assert output.metrics == RequestStateStats(num_generation_tokens=3, num_preemptions=1, arrival_time=10.0,
                                               queued_ts=10.0, scheduled_ts=10.5, first_token_ts=11.0,
                                               last_token_ts=11.0, first_token_latency=1.0)


def test_an_aborted_requests_output_keeps_its_cached_prompt_tokens_with_stats_off():
    """num_cached_tokens is the request's, not the statistics': an abort's last output carries the prompt's prefix
    cache hit whether or not stats are logged (it was 0 with them off)."""
    processor = OutputProcessor(tokenizer=None, log_stats=False)
    params = SamplingParams(max_tokens=4, detokenize=False, output_kind=RequestOutputKind.DELTA)
    processor.add_requests([EngineCoreRequest("r", list(range(10)), params, None, 100.0)], None)
    [first] = processor.process_outputs([EngineCoreOutput("r", [5], num_cached_tokens=8)], None).request_outputs
    [aborted] = processor.abort_requests(["r"]).request_outputs
    assert (first.num_cached_tokens, aborted.num_cached_tokens, aborted.outputs[0].finish_reason) == (8, 8, "abort")


def test_stream_interval_sends_the_first_token_then_every_interval_and_the_end():
    """vLLM's stream_interval: outputs at the first token, then once the tokens unsent reach the interval (the
    engine's, or a request's larger one), and at the end; a stream's deltas join to every token."""
    processor = OutputProcessor(tokenizer=None, stream_interval=2)
    params = [SamplingParams(max_tokens=9, detokenize=False, output_kind=RequestOutputKind.DELTA, stream_interval=k)
              for k in (None, 3)]
    processor.add_requests([EngineCoreRequest("a", [1, 2], params[0], None, 0.0)], None)
    processor.add_requests([EngineCoreRequest("b", [1, 2], params[1], None, 0.0)], None)
    sent: dict[str, list[list[int]]] = {"a": [], "b": []}
    for token in range(9):
        reason = FinishReason.LENGTH if token == 8 else None
        for out in processor.process_outputs([EngineCoreOutput(r, [token], finish_reason=reason) for r in "ab"],
                                             None).request_outputs:
            sent[out.request_id].append(out.outputs[0].token_ids)
    assert sent == {"a": [[0], [1, 2], [3, 4], [5, 6], [7, 8]], "b": [[0], [1, 2, 3], [4, 5, 6], [7, 8]]}


def test_stream_interval_holds_back_no_cumulative_output():
    """As vLLM's (its sent-tokens offset moves in DELTA mode only): a CUMULATIVE request's outputs come every step,
    whatever the stream interval."""
    processor = OutputProcessor(tokenizer=None, stream_interval=3)
    params = SamplingParams(max_tokens=4, detokenize=False, output_kind=RequestOutputKind.CUMULATIVE)
    processor.add_requests([EngineCoreRequest("c", [1, 2], params, None, 0.0)], None)
    sent = [out.outputs[0].token_ids for token in range(4) for out in processor.process_outputs(
        [EngineCoreOutput("c", [token], finish_reason=FinishReason.LENGTH if token == 3 else None)],
        None).request_outputs]
    assert sent == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]


def test_a_users_stat_logger_factory_is_per_engine_as_vllms():
    """vLLM's StatLoggerFactory: called (config, engine_index) once per data-parallel engine, each logger given its
    own engine's records; a factory marked aggregate (pagedllm's own loggers) is called with the config once."""
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_size=2))
    made: list[tuple] = []

    class Logger:
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            made.append((vllm_config, engine_index))
            self.records: list[int] = []
            self.logs = 0

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            self.records.append(engine_idx)

        def log(self) -> None:
            self.logs += 1

    whole = aggregate(lambda vllm_config: Logger(vllm_config))
    per_engine, single = make_stat_loggers([Logger, whole], config)
    assert made == [(config, 0), (config, 1), (config, 0)]
    for engine_idx in (1, 0, 1):
        per_engine.record(None, None, engine_idx=engine_idx)
        single.record(None, None, engine_idx=engine_idx)
    per_engine.log()
    assert [logger.records for logger in per_engine.loggers] == [[0], [1, 1]] and single.records == [1, 0, 1]
    assert [logger.logs for logger in per_engine.loggers] == [1, 1]
