"""Stat-logger factories as vLLM's StatLoggerManager calls them.

vLLM's StatLoggerFactory is per engine: ``factory(vllm_config, engine_index)`` for each data-parallel engine, each
logger recording its own engine's stats; a subclass of its AggregateStatLoggerBase is built once and records them
all. pagedllm's own loggers (Prometheus, the log line) are aggregate: their factories take the config alone and are
marked with ``aggregate``. A user's factory (vLLM-shaped: a StatLoggerBase subclass, or a function of the config and
the engine index) is per engine: its loggers sit behind one PerEngineStatLoggers, which routes each record to the
logger of its ``engine_idx``. start_stat_loggers makes an engine's loggers and tells them it has started, as vLLM's
StatLoggerManager does, for LLMEngine and AsyncLLM alike.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable


def aggregate(factory: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Marks a factory of the config alone, whose one logger records every engine's stats."""
    factory.aggregate = True
    return factory


class PerEngineStatLoggers:
    """vLLM's PerEngineStatLoggerAdapter: one logger per data-parallel engine, from one per-engine factory."""

    def __init__(self, factory: Callable[[Any, int], Any], config: Any) -> None:
        self.loggers = [factory(config, index) for index in range(config.parallel_config.data_parallel_size)]

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        self.loggers[engine_idx].record(scheduler_stats, iteration_stats, mm_cache_stats, engine_idx=engine_idx)

    def log_engine_initialized(self) -> None:
        log_engine_initialized(self.loggers)

    def log(self) -> None:
        log_stat_loggers(self.loggers)


def make_stat_loggers(factories: Iterable[Callable], config: Any) -> list:
    """The loggers of ``factories``: an aggregate one's logger, built once; a per-engine one's loggers behind a
    PerEngineStatLoggers."""
    return [factory(config) if getattr(factory, "aggregate", False) else PerEngineStatLoggers(factory, config)
            for factory in factories]


def start_stat_loggers(factories: Iterable[Callable], config: Any, engine_core: Any) -> list:
    """An engine's stat loggers: those of ``factories`` (make_stat_loggers), each then told that the engine has
    started. A factory or a logger's log_engine_initialized that raises (a user's) stops ``engine_core`` before the
    error propagates: the frontend fails to construct, and its finalizer, which would stop the engine, is not made
    yet, so the engine would run on unwatched and unowned."""
    try:
        stat_loggers = make_stat_loggers(factories, config)
        log_engine_initialized(stat_loggers)
    except BaseException:
        engine_core.shutdown()
        raise
    return stat_loggers


def log_engine_initialized(stat_loggers: list) -> None:
    """vLLM's StatLoggerBase.log_engine_initialized of each logger that has it (a vLLM user's; this engine's log
    nothing then), once the engine has started."""
    for stat_logger in stat_loggers:
        if hasattr(stat_logger, "log_engine_initialized"):
            stat_logger.log_engine_initialized()


def log_stat_loggers(stat_loggers: list) -> None:
    """vLLM's StatLoggerManager.log: log() of each logger that has one (Prometheus' has none: it is scraped)."""
    for stat_logger in stat_loggers:
        if hasattr(stat_logger, "log"):
            stat_logger.log()
