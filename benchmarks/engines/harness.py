"""What every engine runner shares with benchmarks/compare.py: its command line, the warm-up and timed repeats, and
the one result line it prints.

Standard library only, so the vLLM venv can run it without pagedllm installed. A runner supplies an engine object
with ``run(prompts, max_tokens, stream) -> {"wall_s": ..., "ttft_s": ...}`` that resets any prefix cache, generates
greedily with EOS ignored, raises unless every request got exactly ``max_tokens`` tokens, and (when ``stream``)
times the first token of the single request as the caller sees it; ``wall_s`` is then the time of its last token.
An engine may also have an ``info`` dict, reported beside the versions (llama.cpp: its build's system info).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
from typing import Callable

RESULT_MARK = "COMPARE_RESULT "


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload-file", required=True, help="JSON: name, kind, prompts, max_tokens")
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--quantization", help="for runners whose engine takes one (pagedllm: gguf_int4)")
    parser.add_argument("--speculative-config", type=json.loads, help="JSON, vLLM's speculative_config")
    return parser.parse_args()


def main(make_engine: Callable[[argparse.Namespace], object], distribution: str) -> None:
    """Loads the engine once, then either one 1-token start-up run or a warm-up plus ``--repeats`` timed runs."""
    args = parse_args()
    with open(args.workload_file) as f:
        workload = json.load(f)
    start = time.perf_counter()
    engine = make_engine(args)
    load_s = time.perf_counter() - start
    run_args = (workload["prompts"], workload["max_tokens"], workload["kind"] == "stream")
    if workload["kind"] == "startup":
        engine.run(*run_args)
        samples = [{"first_token_time": time.time()}]  # wall clock: compare.py subtracts its spawn time
    else:
        engine.run(*run_args)  # warm-up
        samples = [engine.run(*run_args) for _ in range(args.repeats)]
    info = {"version": importlib.metadata.version(distribution), "torch": installed_version("torch"),
            **getattr(engine, "info", {})}
    print(RESULT_MARK + json.dumps({"load_s": load_s, "info": info, "samples": samples}), flush=True)


def installed_version(distribution: str) -> str | None:
    """None where the runner's venv lacks it (llama.cpp's has no torch)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
