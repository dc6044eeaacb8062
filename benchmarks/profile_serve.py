"""Where `pagedllm serve`'s time goes under load: the engine's step timeline and py-spy profiles of the engine and
API processes, at each client concurrency of compare_serve.py's load (streaming /v1/completions, greedy).

    .venv/bin/python benchmarks/profile_serve.py --concurrency 1,8,32 --out-dir /tmp/profile-serve

For each level: the load's figures (TTFT, ITL, output tok/s), the step timeline's summary (step kinds, time per
step, gaps between steps; benchmarks/step_timeline.py) and, with py-spy on PATH (`pip install py-spy`, not a
pagedllm dependency), the functions each process spent its samples in (own time, and the leading frames), from
py-spy's raw (collapsed-stack) output left in --out-dir. Sampling costs the machine some CPU: compare figures taken
with --no-py-spy, never across the two.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil

from compare_serve import SERVED_NAME, add_load_args, server_command, stop, wait_until_healthy
from step_timeline import summarize

from pagedllm.benchmarks.serve import run_level, serve_prompts
from pagedllm.platforms.cpu import has_native_bf16


def start_py_spy(pid: int, out: Path, rate: int) -> subprocess.Popen:
    return subprocess.Popen([shutil.which("py-spy"), "record", "--pid", str(pid), "--rate", str(rate), "--format",
                             "raw", "--output", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def top_frames(raw: Path, count: int) -> str:
    """The functions with the most samples at the top of the stack (own time), with their share of samples."""
    own: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack:
            continue
        total += int(samples)
        own[stack.split(";")[-1]] += int(samples)
    return "\n".join(f"  {100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(count)) or "  no samples"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pagedllm-model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16" if has_native_bf16() else "float32")
    add_load_args(parser)
    parser.add_argument("--port", type=int, default=8012)
    parser.add_argument("--out-dir", default="/tmp/profile-serve")
    parser.add_argument("--no-py-spy", action="store_true")
    parser.add_argument("--py-spy-rate", type=int, default=50, help="samples per second")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--server-args", default="", help="extra `pagedllm serve` flags, one string")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / "steps.jsonl"
    trace.unlink(missing_ok=True)
    use_py_spy = not args.no_py_spy and shutil.which("py-spy") is not None

    command, env = server_command("pagedllm", args)
    env["PAGEDLLM_STEP_TRACE"] = str(trace)
    url = f"http://127.0.0.1:{args.port}"
    load = argparse.Namespace(base_url=url, model=SERVED_NAME, api_key=None, output_len=args.output_len,
                              request_rate=None)
    log_path = out_dir / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_until_healthy(server, url, args.startup_timeout, log_path)
        (engine,) = [p for p in psutil.Process(server.pid).children(recursive=True) if "core_proc" in " ".join(p.cmdline())]
        asyncio.run(run_level(load, serve_prompts(2, args.input_len, level_index=99), 2))  # warm-up
        results = []
        for index, concurrency in enumerate(int(c) for c in args.concurrency.split(",")):
            spies = {}
            if use_py_spy:
                spies = {name: (start_py_spy(pid, out_dir / f"{name}-{concurrency}.txt", args.py_spy_rate),
                                out_dir / f"{name}-{concurrency}.txt")
                         for name, pid in (("engine", engine.pid), ("api", server.pid))}
                time.sleep(1.0)  # py-spy attached before the load starts
            count = max(args.min_prompts, args.prompts_per_client * concurrency)
            since = time.time()
            result = asyncio.run(run_level(load, serve_prompts(count, args.input_len, index), concurrency))
            until = time.time()
            for spy, _ in spies.values():
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
            with open(trace) as f:
                steps = [s for s in map(json.loads, f) if since <= s["t"] < until]
            print(f"\n=== {concurrency} clients: TTFT p50 {result['ttft_p50_ms']:.0f} ms, p99 "
                  f"{result['ttft_p99_ms']:.0f} ms; ITL p50 {result['itl_p50_ms']:.1f} ms, p99 "
                  f"{result['itl_p99_ms']:.1f} ms; {result['output_tok_s']:.1f} output tok/s"
                  f"{' (py-spy sampling)' if spies else ''}\n{summarize(steps, 50.0)}", flush=True)
            for name, (_, raw) in spies.items():
                if raw.exists():
                    print(f"{name} process, own time by function:\n{top_frames(raw, args.top)}", flush=True)
            results.append({"concurrency": concurrency, **result})
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        stop(server)


if __name__ == "__main__":
    main()
