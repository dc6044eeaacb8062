"""What speculation costs where little matches: a workload with speculative decoding on against the same engine
without it, two engines in one run whose timed runs alternate (off first on even rounds, on first on odd ones),
so the machine's drift between runs falls on both sides alike. Prints each round, the median walls, their ratio
and the sorted paired ratios (off wall / on wall: > 1 means speculation is faster).

    python benchmarks/bench_spec_overhead.py --speculative-config '{"method": "suffix"}' [--workload W1]
        [--rounds 8]

Each run is ``pagedllm bench``'s timed run (the prefix cache reset first); each engine runs the workload once as a
warm-up. The issue's bar: W1 and W2 within 5% of speculation off.
"""
from __future__ import annotations

import argparse
import json
import statistics

from pagedllm import LLM
from pagedllm.benchmarks.offline import timed_run
from pagedllm.benchmarks.workloads import shared_workloads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speculative-config", type=json.loads, required=True, help="vLLM's JSON")
    parser.add_argument("--workload", default="W1", choices=sorted(shared_workloads()))
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    workload = shared_workloads()[args.workload]
    engines = {"off": LLM(), "on": LLM(speculative_config=args.speculative_config)}
    for llm in engines.values():
        timed_run(llm, workload)
    walls: dict[str, list[float]] = {name: [] for name in engines}
    for i in range(args.rounds):
        order = list(engines.items()) if i % 2 == 0 else list(reversed(engines.items()))
        for name, llm in order:
            walls[name].append(timed_run(llm, workload).wall_s)
        print(f"round {i}: off {walls['off'][-1]:.2f} s, on {walls['on'][-1]:.2f} s", flush=True)
    off, on = statistics.median(walls["off"]), statistics.median(walls["on"])
    paired = sorted(a / b for a, b in zip(walls["off"], walls["on"]))
    print(f"{workload.name} {args.speculative_config}: median wall off {off:.2f} s, on {on:.2f} s; "
          f"on vs off (tok/s) {off / on:.3f}x; paired {', '.join(f'{r:.3f}' for r in paired)}")


if __name__ == "__main__":
    main()
