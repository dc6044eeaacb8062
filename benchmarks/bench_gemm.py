"""The default model's 120 linear layers (SmolLM2-135M: 30 x qkv, o, gate_up, down) at the row counts the engine
produces, through each weight layout built here: dense float32 (native panels, at every row count), the
bf16 panels of a bfloat16 model (native/gemm_bf16.c, AVX512-BF16 or AMX), the GGUF Q4_1 panels of
``quantization="gguf_int4"`` (native/gemm.c) and the W8A8 panels of ``quantization="int8"`` (native/gemm_int8.c,
AVX512-VNNI). Random Q4_1 weights, the same values in every layout (each quantizes or rounds them its own way);
prints milliseconds for all 120 layers (best of --repeats, the layouts alternating) and each one's speed-up over
dense float32.

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
from pagedllm.layers.gemm_layout import DenseWeight, QuantizedWeight, WeightLayout
from pagedllm.layers.quantization.int8 import pack_w8a8_panels, quantize_symmetric
from pagedllm.models.gguf_loader import dequantize_fast, unpack_q4

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of qkv, o, gate_up, down
NUM_LAYERS = 30


def _layouts(blocks: np.ndarray) -> dict[str, object]:
    """One layer's weight in every layout built here, each with a ``linear(x)``."""
    weight = torch.from_numpy(dequantize_fast(blocks, GGMLQuantizationType.Q4_1))
    layouts = {"dense f32": DenseWeight(weight)}
    if native.gemm_bf16() is not None:
        layouts["bf16 panels"] = DenseWeight(weight, layout=WeightLayout(bf16_panels=True))
    if native.gemm_q4() is not None:
        layouts["Q4"] = QuantizedWeight.q4(*(torch.from_numpy(p) for p in unpack_q4(blocks,
                                                                                    GGMLQuantizationType.Q4_1)))
    if native.gemm_w8a8() is not None:
        layouts["W8A8"] = QuantizedWeight.w8a8(pack_w8a8_panels(*quantize_symmetric(weight)), weight.shape[0])
    return layouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    layers = []
    for _ in range(NUM_LAYERS):
        for out_features, in_features in SHAPES:
            blocks = quantize(rng.standard_normal((out_features, in_features), dtype=np.float32),
                              GGMLQuantizationType.Q4_1)
            layers.append((_layouts(blocks), in_features))
    names = list(layers[0][0])
    flop_per_row = 2 * NUM_LAYERS * sum(o * i for o, i in SHAPES)
    print(f"{'rows':>6}" + "".join(f"{name + ' ms':>16}" for name in names)
          + "".join(f"{name + ' x':>14}" for name in names[1:]) + f"{'best GFLOP/s':>14}")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {i: torch.randn(rows, i) for _, i in SHAPES}
        best = dict.fromkeys(names, float("inf"))
        for _ in range(args.repeats):
            for name in names:
                start = time.perf_counter()
                for layouts, in_features in layers:
                    layouts[name].linear(inputs[in_features])
                best[name] = min(best[name], time.perf_counter() - start)
        dense = best["dense f32"]
        print(f"{rows:>6}" + "".join(f"{best[n] * 1e3:>16.2f}" for n in names)
              + "".join(f"{dense / best[n]:>14.2f}" for n in names[1:])
              + f"{flop_per_row * rows / min(best.values()) / 1e9:>14.0f}")


if __name__ == "__main__":
    main()
