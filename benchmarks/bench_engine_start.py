"""How long an engine takes to start when the process has started one before: LLM() until it returns, with the fork
server (forkserver.py) against fresh interpreters (PAGEDLLM_WORKER_MULTIPROC_METHOD=spawn), taking turns in one
process. The first engine (which starts the fork server) is a warm-up and not counted: it costs the same either way.

    python benchmarks/bench_engine_start.py [--rounds 3] [--tensor-parallel-size 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from pagedllm import LLM
from pagedllm.forkserver import METHOD_ENV


def start_and_stop(tensor_parallel_size: int) -> float:
    """Seconds from LLM() to its return (the engine, and its workers, up); the engine is stopped after."""
    start = time.perf_counter()
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory="64MiB", tensor_parallel_size=tensor_parallel_size)
    ready = time.perf_counter() - start
    llm.shutdown()
    return ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    start_and_stop(args.tensor_parallel_size)
    seconds: dict[str, list[float]] = {"spawn": [], "forkserver": []}
    for _ in range(args.rounds):
        for method in seconds:
            os.environ[METHOD_ENV] = method
            seconds[method].append(start_and_stop(args.tensor_parallel_size))
    medians = {method: statistics.median(values) for method, values in seconds.items()}
    for method, values in seconds.items():
        print(f"{method:>10}: LLM() ready in {medians[method]:.2f} s median "
              f"({', '.join(f'{v:.2f}' for v in values)}), tensor_parallel_size={args.tensor_parallel_size}")
    print(f"fork server: {medians['spawn'] / medians['forkserver']:.2f}x faster to start")


if __name__ == "__main__":
    main()
