"""`pagedllm serve` vs `vllm serve` under the same streaming load: time to first token (p50, p99), inter-token
latency (p50, p99) and output tok/s at fixed client concurrencies (default 1, 8 and 32).

Each round starts every server in turn (--engines order) on the same port, waits for /health, warms it up with
two requests, drives each concurrency level with pagedllm.benchmarks.serve (prompts of their own per level, the
same for both servers; streamed, greedy, ignore_eos, exact output lengths checked against the usage the server
reports) and stops it. A fresh server per round means an empty prefix cache. Setup (the vLLM venv, the HF model
dir, tcmalloc), once: `bash benchmarks/setup_vllm_cpu.sh`. Then, from the checkout:

    .venv/bin/python benchmarks/compare_serve.py --vllm-python .bench/venv-vllm/bin/python \
        --output-json compare_serve.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from compare import add_engine_source_args, vllm_env
from compare_report import pagedllm_better_by

from pagedllm.benchmarks.serve import run_level, serve_prompts
from pagedllm.platforms.cpu import has_native_bf16

SERVED_NAME = "smollm2-135m-instruct"
# (key in a level's result, label, higher is better)
FIGURES = [("ttft_p50_ms", "TTFT p50 ms", False), ("ttft_p99_ms", "TTFT p99 ms", False),
           ("itl_p50_ms", "ITL p50 ms", False), ("itl_p99_ms", "ITL p99 ms", False),
           ("output_tok_s", "output tok/s", True)]


def add_load_args(parser: argparse.ArgumentParser) -> None:
    """The load's shape and the server's start-up limit, shared with profile_serve.py."""
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts")
    parser.add_argument("--prompts-per-client", type=int, default=2)
    # At one client, 6 requests left the p50 to the first one's (a server's first request of a prompt shape
    # captures its CPU graph): 16 make the medians stable across runs.
    parser.add_argument("--min-prompts", type=int, default=16, help="requests at least, per level")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--startup-timeout", type=float, default=600)


def server_command(engine: str, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    common = ["--port", str(args.port), "--dtype", args.dtype, "--served-model-name", SERVED_NAME]
    extra = args.server_args.split()  # flags the server takes beyond these (both servers': vLLM's names), last
    if engine == "pagedllm":
        # The KV cache faulted in before the server is ready, as vLLM's (it zeroes its cache at start-up): like
        # for like where first touches are slow (VMs), rather than pagedllm paying them inside the timed load.
        return ([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", args.pagedllm_model, *common,
                 "--kv-cache-populate", "startup", "--uvicorn-log-level", "warning", *extra], dict(os.environ))
    if engine == "vllm":
        if not args.vllm_python:
            raise SystemExit("vllm needs --vllm-python (setup: bash benchmarks/setup_vllm_cpu.sh)")
        # the module, not the `vllm` script, which looks up package metadata that vllm-cpu names differently
        return ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.hf_model_dir, *common,
                 "--seed", "0", *extra], vllm_env(args.vllm_python))
    raise SystemExit(f"unknown engine {engine!r}; choose from pagedllm, vllm")


def wait_until_healthy(process: subprocess.Popen, url: str, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not healthy within {timeout} s; see {log_path}")


def stop(process: subprocess.Popen) -> None:
    """SIGINT to the server's whole session (its engine processes too), SIGKILL if it lingers."""
    for sig, wait_s in ((signal.SIGINT, 60), (signal.SIGKILL, 30)):
        if process.poll() is not None:
            return
        os.killpg(process.pid, sig)
        try:
            process.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass


def bench_server(engine: str, args: argparse.Namespace, log_path: Path) -> list[dict]:
    """Starts the engine's server, runs every concurrency level against it, stops it; the levels' results."""
    command, env = server_command(engine, args)
    url = f"http://127.0.0.1:{args.port}"
    load = argparse.Namespace(base_url=url, model=SERVED_NAME, api_key=None, output_len=args.output_len,
                              request_rate=None)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_until_healthy(process, url, args.startup_timeout, log_path)
        asyncio.run(run_level(load, serve_prompts(2, args.input_len, level_index=99), 2))  # warm-up
        results = []
        for index, concurrency in enumerate(args.concurrency):
            count = max(args.min_prompts, args.prompts_per_client * concurrency)
            result = asyncio.run(run_level(load, serve_prompts(count, args.input_len, index), concurrency))
            print(f"  {engine} concurrency {concurrency}: " + ", ".join(
                f"{label} {result[key]:.1f}" for key, label, _ in FIGURES), flush=True)
            results.append(result)
        return results
    finally:
        stop(process)


def summarize(runs: list[dict], engines: list[str], concurrencies: list[int]) -> list[dict]:
    """Per (concurrency, figure): each engine's median over rounds and pagedllm's ratio (> 1: pagedllm better)."""
    rows = []
    for concurrency in concurrencies:
        for key, label, higher_is_better in FIGURES:
            medians = {}
            for engine in engines:
                values = [level[key] for run in runs if run["engine"] == engine
                          for level in run["levels"] if level["concurrency"] == concurrency]
                if values:
                    medians[engine] = statistics.median(values)
            rows.append({"concurrency": concurrency, "figure": label, "medians": medians,
                         "pagedllm_better_by": pagedllm_better_by(medians, higher_is_better)})
    return rows


def markdown(rows: list[dict], engines: list[str]) -> str:
    others = [e for e in engines if e != "pagedllm"]
    head = ["clients", "figure", *engines, *(f"pagedllm vs {e} (>1: pagedllm better)" for e in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [str(row["concurrency"]), row["figure"]]
        cells += [f"{row['medians'][e]:.1f}" if e in row["medians"] else "n/a" for e in engines]
        cells += [f"{row['pagedllm_better_by'][e]:.2f}x" if e in row["pagedllm_better_by"] else "n/a" for e in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_source_args(parser, "pagedllm,vllm")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        default="bfloat16" if has_native_bf16() else "float32",
                        help="for both servers (default: bfloat16 only where the CPU has native bf16 matmuls, as in "
                             "compare.py)")
    add_load_args(parser)
    parser.add_argument("--server-args", default="",
                        help="extra flags both servers take (vLLM's names), one string, e.g. '--stream-interval 4'")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--log-dir", help="server logs (default: a new temporary directory)")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.engines = args.engines.split(",")
    return args


def main() -> None:
    args = parse_args()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pagedllm-compare-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs: {log_dir}", flush=True)
    runs = []
    for round_index in range(args.rounds):
        for engine in args.engines:
            print(f"round {round_index + 1}/{args.rounds}: {engine}", flush=True)
            levels = bench_server(engine, args, log_dir / f"{engine}-{round_index}.log")
            runs.append({"engine": engine, "round": round_index, "levels": levels})
    rows = summarize(runs, args.engines, args.concurrency)
    print(f"\n{args.input_len} prompt tokens -> {args.output_len} output tokens per request, "
          f"{args.prompts_per_client} requests per client (at least {args.min_prompts}), dtype {args.dtype}, "
          f"medians of {args.rounds} round(s)\n\n" + markdown(rows, args.engines))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
