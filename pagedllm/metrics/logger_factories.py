"""Stat-logger factories as vLLM's StatLoggerManager calls them.

vLLM's StatLoggerFactory is per engine: ``factory(vllm_config, engine_index)`` for each data-parallel engine, each
logger recording its own engine's stats; a subclass of its AggregateStatLoggerBase is built once and records them
all. pagedllm's own loggers (Prometheus, the log line) are aggregate: their factories take the config alone and are
marked with ``aggregate``. A user's factory (vLLM-shaped: a StatLoggerBase subclass, or a function of the config and
the engine index) is per engine: its loggers sit behind one PerEngineStatLoggers, which routes each record to the
logger of its ``engine_idx``.
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
        for stat_logger in self.loggers:
            if hasattr(stat_logger, "log_engine_initialized"):
                stat_logger.log_engine_initialized()

    def log(self) -> None:
        for stat_logger in self.loggers:
            if hasattr(stat_logger, "log"):
                stat_logger.log()


def make_stat_loggers(factories: Iterable[Callable], config: Any) -> list:
    """The loggers of ``factories``: an aggregate one's logger, built once; a per-engine one's loggers behind a
    PerEngineStatLoggers."""
    return [factory(config) if getattr(factory, "aggregate", False) else PerEngineStatLoggers(factory, config)
            for factory in factories]
