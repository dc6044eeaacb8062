"""The CUDA platform's check on one GPU, in a few minutes; prints one table (and writes it to --out).

1. The CUDA tests: tests/e2e/test_cuda.py (greedy parity with transformers in float32 on the default model, 8 mixed
   prompts x 48 tokens with chunked prefill and preemption; auto device and dtype with a profiled KV cache) and
   tests/test_triton_attention_kernels.py, the Triton kernels compiled for the GPU against torch references.
2. W1, W2 and W3 (pagedllm/benchmarks/workloads.py) through pagedllm (device cuda, bfloat16) and through
   transformers' generate on the same GPU, the same bf16 weights (the default model's GGUF, dequantized and rounded
   to bf16 once, written as a Hugging Face directory both load), one engine after the other.
3. W2's decode step: its time in each engine ((256-token run - 1-token run) / 255) against the weights-read bound,
   the model's bf16 bytes over the bandwidth of a device-to-device copy measured in the same run.
4. CUDA graphs against eager decode steps at batch 1: not built yet, and said so.

Run from a checkout on the GPU machine, where torch (a CUDA build), transformers and triton are installed and the
project's other dependencies are importable (benchmarks/gpu_check.sh installs them from carried wheels):

    PYTHONPATH=. python3 benchmarks/gpu_check.py --out /tmp/gpu_check.md

``--device cpu --smoke`` runs the same script on the CPU with two-request workloads of 8 tokens, to find its mistakes
before a GPU's minutes are spent on them (its figures mean nothing).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: its tests/ helpers
from pagedllm.benchmarks.workloads import Workload, shared_workloads  # noqa: E402

TESTS = ["tests/e2e/test_cuda.py", "tests/test_triton_attention_kernels.py"]


def write_bf16_model(directory: str) -> int:
    """The default model as a bf16 Hugging Face directory (weights and tokenizer); returns its weights' bytes."""
    from pagedllm.models.hf_config import load_tokenizer
    from tests.model_fixtures import smollm_path, smollm_reference

    model = smollm_reference().to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    load_tokenizer(smollm_path()).save_pretrained(directory)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes a second a device-to-device copy of 1 GiB moves, counting its reads and writes."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    synchronize(device)
    return 2 * 10 * source.numel() / (time.perf_counter() - start)


def time_pagedllm(model_dir: str, device: str, workloads: dict) -> dict[str, float]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model_dir, device=device, dtype="bfloat16", max_model_len=2048)
    try:
        def run(prompts, max_tokens) -> float:
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
            return time.perf_counter() - start
        return _workload_times(run, workloads)
    finally:
        llm.shutdown()


def time_transformers(model_dir: str, device: str, workloads: dict) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()

    def run(prompts, max_tokens) -> float:
        ids = torch.tensor(prompts, device=device)
        synchronize(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        synchronize(device)
        return time.perf_counter() - start
    return _workload_times(run, workloads)


def _workload_times(run, workloads: dict) -> dict[str, float]:
    """Output tokens a second of W1-W3 and W2's decode step (s), each after a warm-up run of its shape."""
    results = {}
    for name, workload in workloads.items():
        run(workload.prompts, 4)
        results[name] = workload.output_tokens / run(workload.prompts, workload.max_tokens)
    w2 = workloads["W2"]
    results["W2 step"] = (run(w2.prompts, w2.max_tokens) - run(w2.prompts, 1)) / (w2.max_tokens - 1)
    return results


def smoke_workloads() -> dict:
    """W1-W3 cut to two requests of 8 output tokens each (prompts as they are)."""
    return {name: Workload(name, workload.prompts[:2], 8) for name, workload in shared_workloads().items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--smoke", action="store_true", help="two-request workloads of 8 tokens: a dry run")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA GPU: this check runs on a GPU machine (--device cpu --smoke: a dry run)")
    workloads = smoke_workloads() if args.smoke else shared_workloads()
    rows = [("device", torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)", "", "")]
    if not args.skip_tests:
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]).returncode
        rows.append(("CUDA tests", "passed" if rc == 0 else f"FAILED (pytest rc {rc})", "", ""))
    with tempfile.TemporaryDirectory() as model_dir:
        weight_bytes = write_bf16_model(model_dir)
        ours = time_pagedllm(model_dir, args.device, workloads)
        theirs = time_transformers(model_dir, args.device, workloads)
    for name in ("W1", "W2", "W3"):
        rows.append((f"{name} output tok/s", f"{ours[name]:.1f}", f"{theirs[name]:.1f}",
                     f"{ours[name] / theirs[name]:.2f}x"))
    bandwidth = copy_bandwidth(args.device)
    bound = weight_bytes / bandwidth
    rows.append(("W2 decode step (ms)", f"{ours['W2 step'] * 1e3:.3f}", f"{theirs['W2 step'] * 1e3:.3f}",
                 f"{theirs['W2 step'] / ours['W2 step']:.2f}x"))
    rows.append(("W2 weights-read bound (ms)", f"{bound * 1e3:.3f}",
                 f"{weight_bytes / 1e6:.1f} MB at {bandwidth / 1e12:.2f} TB/s",
                 f"step {ours['W2 step'] / bound:.1f}x it"))
    rows.append(("CUDA graphs vs eager, batch 1", "not built yet (every step eager)", "", ""))
    table = "\n".join(["| | pagedllm | transformers | ratio |", "|---|---|---|---|"]
                      + [f"| {' | '.join(row)} |" for row in rows])
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0 if all("FAILED" not in row[1] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
