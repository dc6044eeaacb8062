"""`pagedllm bench throughput | latency | serve`: the shape of `vllm bench`, printing a table and writing JSON."""
from __future__ import annotations

import argparse
import json

from pagedllm.entrypoints.openai.cli_args import add_engine_args, engine_kwargs_from
from pagedllm.models.resolve import DEFAULT_MODEL

def _make_llm(args: argparse.Namespace):
    from pagedllm.entrypoints.llm import LLM
    return LLM(args.model, **engine_kwargs_from(args))


def _write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2, default=lambda value: None)  # e.g. the argparse handler


def _workloads(args: argparse.Namespace, default: str):
    from pagedllm.benchmarks.workloads import random_workload, shared_workloads
    if args.workload == "random":
        return [random_workload("random", args.num_prompts, args.input_len, args.output_len, args.prefix_len)]
    names = (args.workload or default).split(",")
    shared = shared_workloads()
    if any(n.startswith("W4") for n in names):  # input-grounded prompts are text: the model's tokenizer makes them
        from pagedllm.benchmarks.workloads import grounded_workloads
        from pagedllm.models.hf_config import load_tokenizer
        from pagedllm.models.resolve import resolve_model
        shared.update(grounded_workloads(load_tokenizer(resolve_model(args.model))))
    unknown = [n for n in names if n not in shared]
    if unknown:
        raise SystemExit(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(shared)}, random")
    return [shared[n] for n in names]


def run_offline(args: argparse.Namespace, default_workload: str) -> None:
    from pagedllm.benchmarks.offline import bench_workload, print_table
    llm = _make_llm(args)
    results = [bench_workload(llm, w, args.repeats) for w in _workloads(args, default_workload)]
    print_table(results)
    _write_json(args.output_json, {"results": [r.as_dict() for r in results], "args": vars(args)})
    llm.shutdown()


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark throughput, latency, or a running server")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    for kind, default, help_text in (("throughput", "W1", "offline throughput (default W1; W3 for shared prefix)"),
                                     ("latency", "W2", "one request: time to first token and decode tok/s")):
        p = kinds.add_parser(kind, help=help_text)
        p.add_argument("--model", default=DEFAULT_MODEL)
        add_engine_args(p)
        p.set_defaults(disable_log_stats=True)  # offline, as LLM(): statistics only when --no-disable-log-stats
        p.add_argument("--workload", help=f"W1, W2, W3, W4 (input-grounded, one stream), W4-8 (eight) "
                                          f"(comma-separated), or 'random'; default {default}")
        p.add_argument("--num-prompts", type=int, default=64 if kind == "throughput" else 1)
        p.add_argument("--input-len", type=int, default=256)
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--prefix-len", type=int, default=0)
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--output-json")
        p.set_defaults(bench_func=lambda a, d=default: run_offline(a, d))
    from pagedllm.benchmarks.serve import add_serve_bench_args, run_serve_bench
    p = kinds.add_parser("serve", help="drive an OpenAI endpoint at a request rate or fixed concurrency")
    add_serve_bench_args(p)
    p.add_argument("--output-json")
    p.set_defaults(bench_func=lambda a: _write_json(a.output_json, run_serve_bench(a)))
