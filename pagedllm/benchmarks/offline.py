"""Timing of offline runs: one warm-up, then the median of timed repeats, the prefix cache reset before each."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from pagedllm.benchmarks.workloads import Workload
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RunResult:
    wall_s: float
    ttft_s: float  # first token of the first request


@dataclass
class BenchResult:
    workload: str
    num_requests: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    ttft_ms: float
    decode_tok_s: float  # per sequence, after the first token (single-request workloads)
    runs: list

    def as_dict(self) -> dict:
        return asdict(self)


def timed_run(llm: LLM, workload: Workload) -> RunResult:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    for i, prompt in enumerate(workload.prompts):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": prompt}, params)
    first_token = None
    num_tokens: dict[str, int] = {}
    finished = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first_token is None and out.request_id == "bench-0":
                first_token = time.perf_counter() - start
            num_tokens[out.request_id] = num_tokens.get(out.request_id, 0) + len(out.outputs[0].token_ids)
            if out.finished:
                if num_tokens[out.request_id] != workload.max_tokens:
                    raise RuntimeError(f"{out.request_id} produced {num_tokens[out.request_id]} tokens")
                finished += 1
    if finished != workload.num_requests:
        raise RuntimeError(f"only {finished} of {workload.num_requests} requests finished")
    return RunResult(time.perf_counter() - start, first_token or 0.0)


def bench_workload(llm: LLM, workload: Workload, repeats: int = 3) -> BenchResult:
    timed_run(llm, workload)  # warm-up
    runs = [timed_run(llm, workload) for _ in range(repeats)]
    wall = statistics.median(r.wall_s for r in runs)
    ttft = statistics.median(r.ttft_s for r in runs)
    decode = (workload.max_tokens - 1) / (wall - ttft) if workload.num_requests == 1 and wall > ttft else 0.0
    return BenchResult(workload.name, workload.num_requests, workload.output_tokens, wall,
                       workload.output_tokens / wall, ttft * 1000, decode, [asdict(r) for r in runs])


def print_table(results: list[BenchResult]) -> None:
    print(f"{'workload':<12}{'requests':>9}{'wall s':>9}{'out tok/s':>11}{'TTFT ms':>9}{'decode tok/s':>14}")
    for r in results:
        decode = f"{r.decode_tok_s:.1f}" if r.decode_tok_s else "-"
        print(f"{r.workload:<12}{r.num_requests:>9}{r.wall_s:>9.2f}{r.output_tok_s:>11.1f}{r.ttft_ms:>9.1f}"
              f"{decode:>14}")
