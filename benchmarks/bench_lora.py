"""Multi-LoRA serving cost: W1 (64 x 256 prompt + 128 out) with 4 adapters spread over the batch against the base
model alone (an engine without enable_lora), and W2 (one stream, 32 + 256) with one adapter against none, in one
run (the runs alternate, base first; medians); also the LoRA engine's own requests without an adapter. And the
memory an adapter slot takes.

    python benchmarks/bench_lora.py [--rank 16] [--repeats 3] [--dtype auto] [--workloads W1,W2]

The adapters are random, of rank ``--rank`` on all seven projections (the costliest case), written as PEFT
directories in a temporary folder. Ratios are what to compare across machines; absolute figures only within a
run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.benchmarks.workloads import shared_workloads
from pagedllm.lora.lora_model import LORA_TARGETS, NUM_SLICES, slice_shapes
from pagedllm.models.hf_config import load_hf_config
from pagedllm.models.resolve import DEFAULT_MODEL, resolve_model
from pagedllm.native.lora_ops import lanes

NUM_ADAPTERS = 4


def write_adapter(path: Path, hf_config, rank: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    shapes = slice_shapes(hf_config)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, (fused, index) in LORA_TARGETS.items():
            in_features, out_features = shapes[fused][index]
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": [m.split(".")[-1] for m in LORA_TARGETS]}))
    save_file(tensors, str(path / "adapter_model.safetensors"))


def slot_bytes(hf_config, rank: int, dtype: torch.dtype) -> int:
    """One adapter slot in every LoRA'd layer, on one rank: A (each slice's side by side, padded to whole lanes)
    and B (each slice's in its own columns), at max_lora_rank, in the model's dtype (lora/layers.LinearLoRA); and
    the token embedding's A and B and the LM head's (lora/layers.EmbeddingLoRA, LogitsLoRA)."""
    per_layer = 0
    for fused, num_slices in NUM_SLICES.items():
        shapes = slice_shapes(hf_config)[fused]
        per_layer += (shapes[0][0] * lanes(num_slices * rank) + rank * sum(out for _, out in shapes)) * dtype.itemsize
    vocab, hidden = hf_config.vocab_size, hf_config.hidden_size
    outside = (vocab * rank + rank * hidden) + (hidden * lanes(rank) + rank * vocab)
    return per_layer * hf_config.num_hidden_layers + outside * dtype.itemsize


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int, loras) -> float:
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    wall = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--workloads", default="W1,W2")
    args = parser.parse_args()
    hf_config = load_hf_config(resolve_model(DEFAULT_MODEL))
    workloads = shared_workloads()
    with tempfile.TemporaryDirectory() as folder:
        adapters = []
        for i in range(NUM_ADAPTERS):
            write_adapter(Path(folder) / f"adapter-{i}", hf_config, args.rank, i)
            adapters.append(LoRARequest(f"adapter-{i}", i + 1, str(Path(folder) / f"adapter-{i}")))
        plain = LLM(dtype=args.dtype)
        llm = LLM(dtype=args.dtype, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank)
        dtype = llm.llm_engine.config.model_config.dtype
        print(f"rank {args.rank}; one adapter slot: {slot_bytes(hf_config, args.rank, dtype) / 2**20:.1f} MiB "
              f"({str(dtype).removeprefix('torch.')}, {hf_config.num_hidden_layers} layers x 7 projections)")
        print("base: an engine without enable_lora; LoRA engine, no adapter: the base model's requests on the "
              "engine with enable_lora")
        print(f"{'workload':<10}{'adapters':>10}{'base s':>9}{'no adapter s':>14}{'LoRA s':>9}"
              f"{'no adapter / base':>19}{'LoRA / base speed':>19}")
        for name in args.workloads.split(","):
            workload = workloads[name]
            n = workload.num_requests
            loras = [adapters[i % NUM_ADAPTERS] for i in range(n)] if n > 1 else adapters[0]
            timed(plain, workload.prompts, 8, None)  # warm-up: adapters loaded, kernels built, graphs captured
            timed(llm, workload.prompts, 8, loras)
            base, no_adapter, lora = [], [], []
            for _ in range(args.repeats):
                base.append(timed(plain, workload.prompts, workload.max_tokens, None))
                no_adapter.append(timed(llm, workload.prompts, workload.max_tokens, None))
                lora.append(timed(llm, workload.prompts, workload.max_tokens, loras))
            b, u, l_ = statistics.median(base), statistics.median(no_adapter), statistics.median(lora)
            print(f"{name:<10}{min(n, NUM_ADAPTERS):>10}{b:>9.2f}{u:>14.2f}{l_:>9.2f}{b / u:>18.2f}x{b / l_:>18.2f}x")
        llm.shutdown()
        plain.shutdown()


if __name__ == "__main__":
    main()
