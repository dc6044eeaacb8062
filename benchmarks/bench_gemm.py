"""The default model's 120 linear layers (SmolLM2-135M: 30 x qkv, o, gate_up, down) at the row counts the engine
produces, through each weight layout: dense float32 (native panels up to 128 rows, MKL above) and the GGUF Q4_1
panels of ``quantization="gguf_int4"`` (native/gemm.c). Random Q4_1 weights, the same values in both layouts;
prints milliseconds for all 120 layers (best of --repeats, the two layouts alternating) and the ratio.

    python benchmarks/bench_gemm.py [--rows 1,4,16,64,256] [--repeats 7]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagedllm import native
from pagedllm.layers.gemm_layout import DenseWeight, QuantizedWeight
from pagedllm.models.gguf_loader import dequantize_fast, unpack_q4

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of qkv, o, gate_up, down
NUM_LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if native.gemm_q4() is None:
        raise SystemExit("no native GEMM here (needs a C compiler and AVX-512)")
    rng = np.random.default_rng(0)
    layers = []
    for _ in range(NUM_LAYERS):
        for out_features, in_features in SHAPES:
            blocks = quantize(rng.standard_normal((out_features, in_features), dtype=np.float32),
                              GGMLQuantizationType.Q4_1)
            parts = [torch.from_numpy(p) for p in unpack_q4(blocks, GGMLQuantizationType.Q4_1)]
            dense = DenseWeight(torch.from_numpy(dequantize_fast(blocks, GGMLQuantizationType.Q4_1)))
            layers.append((dense, QuantizedWeight.q4(*parts), in_features))
    flop_per_row = 2 * NUM_LAYERS * sum(o * i for o, i in SHAPES)
    print(f"{'rows':>6}{'dense ms':>11}{'Q4 ms':>9}{'dense/Q4':>10}{'Q4 GFLOP/s':>12}")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {i: torch.randn(rows, i) for _, i in SHAPES}
        best = {"dense": float("inf"), "q4": float("inf")}
        for _ in range(args.repeats):
            for name, index in (("dense", 0), ("q4", 1)):
                start = time.perf_counter()
                for layer in layers:
                    layer[index].linear(inputs[layer[2]])
                best[name] = min(best[name], time.perf_counter() - start)
        print(f"{rows:>6}{best['dense'] * 1e3:>11.2f}{best['q4'] * 1e3:>9.2f}{best['dense'] / best['q4']:>10.2f}"
              f"{flop_per_row * rows / best['q4'] / 1e9:>12.0f}")


if __name__ == "__main__":
    main()
