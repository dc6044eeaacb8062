"""Where one decode step of a shared workload (W1, W2 or W3) spends its time: model forward (attention vs the
rest), LM head, sampling, input preparation and scheduling. In-process engine, float32 by default, steps run
eagerly (a CPU graph replays the forward's kernels without the modules this times); prints a table.

    python benchmarks/profile_decode_step.py [--workload W1] [--dtype float32] [--steps 5]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"  # time the engine, not the IPC

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.benchmarks.workloads import shared_workloads  # noqa: E402
from pagedllm.layers.attention.cpu_backend import TorchSDPABackendImpl  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="W1", choices=("W1", "W2", "W3"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype, max_model_len=2048, enforce_eager=True)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    workload = shared_workloads()[args.workload]
    params = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens, ignore_eos=True)
    for i, prompt in enumerate(workload.prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    while len(core.scheduler.waiting) or any(r.num_output_tokens < 2 for r in core.scheduler.running):
        engine.step()  # prefill everything and take two decode steps

    timers = {"forward": 0.0, "attention": 0.0, "logits": 0.0, "sampler": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            result = fn(*a, **k)
            timers[name] += time.perf_counter() - start
            return result
        return wrapper

    runner = core.executor.worker.model_runner
    runner.model.forward = timed("forward", runner.model.forward)
    runner.model.compute_logits = timed("logits", runner.model.compute_logits)
    runner.sampler.forward = timed("sampler", runner.sampler.forward)
    TorchSDPABackendImpl.forward = timed("attention", TorchSDPABackendImpl.forward)
    t_exec = t_sched = 0.0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        scheduler_output = core.scheduler.schedule()
        t1 = time.perf_counter()
        model_runner_output = core.executor.execute_model(scheduler_output)
        t2 = time.perf_counter()
        core.scheduler.update_from_output(scheduler_output, model_runner_output)
        t_exec += t2 - t1
        t_sched += time.perf_counter() - t2 + t1 - t0
    total = t_exec + t_sched
    rows = [("model forward", timers["forward"]), ("  attention", timers["attention"]),
            ("  linear, norm, rope, other", timers["forward"] - timers["attention"]),
            ("LM head", timers["logits"]), ("sampling", timers["sampler"]),
            ("input preparation, state update", t_exec - timers["forward"] - timers["logits"] - timers["sampler"]),
            ("scheduling (schedule + update)", t_sched)]
    print(f"{args.workload} decode step, batch {scheduler_output.total_num_scheduled_tokens}, {args.dtype}, "
          f"mean of {args.steps}: {total / args.steps * 1e3:.1f} ms")
    for name, seconds in rows:
        print(f"  {name:<36}{seconds / args.steps * 1e3:9.2f} ms {100 * seconds / total:6.1f}%")


if __name__ == "__main__":
    main()
