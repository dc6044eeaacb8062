"""A mixture-of-experts layer alone (float32, random weights): the native layer (native/fused_moe.c: routing and
experts in one call, what CPU graphs replay) against the torch path (layers/fused_moe.py's select_experts and
fused_experts: a sort by expert, one GEMM pair per active expert), at the token counts a step brings; and the same
experts quantized to a GGUF type and kept packed (layers/quantization/gguf_moe.py: the torch path's routing, each
active expert through gemm.c's quantized panels); and, where gemm_bf16 builds, the experts of a bfloat16 model in
bf16 panels (native/moe_bf16.c, what such a model runs at every step). Prints milliseconds per call (best of
--repeats, the layers alternating), the native layer's speed-up over torch, and the packed and bf16-panel layers'
speed-ups over the native one.

    python benchmarks/bench_moe.py [--tokens 1,4,16,64,128,256] [--experts 8] [--top-k 2] [--hidden 1024]
                                   [--intermediate 2816] [--gguf-type Q4_1]
"""
from __future__ import annotations

import argparse
import time

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagedllm import native
from pagedllm.layers.fused_moe import FusedMoE, expert_param_name, fused_experts, select_experts
from pagedllm.layers.gemm_layout import WeightLayout
from pagedllm.layers.quantization.gguf import GGUFConfig
from pagedllm.models.gguf_loader import PACKED_PARTS, unpack
from pagedllm.native.fused import fused_moe


def _best_ms(call, repeats: int, calls: int = 10) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def packed_layer(w13: torch.Tensor, w2: torch.Tensor, top_k: int, tensor_type: GGMLQuantizationType) -> FusedMoE:
    """A FusedMoE whose experts are ``w13``/``w2`` quantized to ``tensor_type`` and kept packed."""
    experts, inter2, hidden = w13.shape
    names = ("gate", "down", "up")
    config = GGUFConfig({f"experts.{{expert}}.{name}.weight": tensor_type for name in names}, [], names)
    layer = FusedMoE(experts, top_k, hidden, inter2 // 2, True, quant_config=config, prefix="experts")
    params = dict(layer.named_parameters())
    for expert in range(experts):
        gate, up = w13[expert].chunk(2)
        for shard, weight in (("w1", gate), ("w3", up), ("w2", w2[expert])):
            for part, array in zip(PACKED_PARTS, unpack(quantize(weight.numpy(), tensor_type), tensor_type)):
                param = params[expert_param_name(shard, part)]
                param.weight_loader(param, torch.from_numpy(array), expert, shard)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def bf16_panel_layer(w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> FusedMoE:
    """A FusedMoE whose experts ``w13``/``w2`` are laid out in bf16 panels, as a bfloat16 model's are."""
    experts, inter2, hidden = w13.shape
    layer = FusedMoE(experts, top_k, hidden, inter2 // 2, True)
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    layer.quant_method.process_weights_after_loading(layer, WeightLayout(bf16_panels=True))
    return layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,4,16,64,128,256")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--gguf-type", default="Q4_1", help="a type gguf-py quantizes (Q4_0, Q4_1, Q8_0)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if native.fused_ops() is None:
        raise SystemExit("no native kernels here (native/build.py: a C compiler is needed)")
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter = args.experts, args.hidden, args.intermediate
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.02
    tensor_type = GGMLQuantizationType[args.gguf_type]
    packed = packed_layer(w13, w2, args.top_k, tensor_type)
    print(f"{experts} experts, top-{args.top_k}, hidden {hidden}, intermediate {inter}, float32, "
          f"{torch.get_num_threads()} threads")
    bf16 = bf16_panel_layer(w13, w2, args.top_k) if native.moe_bf16() is not None else None
    packed_name = f"{tensor_type.name} ms"
    print(f"{'tokens':>8}{'torch ms':>12}{'native ms':>12}{'native x':>10}{packed_name:>12}{'vs native':>11}"
          + (f"{'bf16 ms':>10}{'vs native':>11}" if bf16 is not None else ""))
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            x, logits = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, experts, generator=gen)
            torch_ms = native_ms = packed_ms = bf16_ms = float("inf")
            for _ in range(2):  # alternating, the better of each
                torch_ms = min(torch_ms, _best_ms(
                    lambda: fused_experts(x, w13, w2, *select_experts(logits, args.top_k, True)), args.repeats))
                native_ms = min(native_ms, _best_ms(lambda: fused_moe(x, logits, w13, w2, args.top_k, True),
                                                    args.repeats))
                packed_ms = min(packed_ms, _best_ms(lambda: packed(x, logits), args.repeats))
                if bf16 is not None:
                    bf16_ms = min(bf16_ms, _best_ms(lambda: bf16(x, logits), args.repeats))
            print(f"{tokens:>8}{torch_ms:>12.2f}{native_ms:>12.2f}{torch_ms / native_ms:>10.2f}{packed_ms:>12.2f}"
                  f"{native_ms / packed_ms:>10.2f}x" + (f"{bf16_ms:>10.2f}{native_ms / bf16_ms:>10.2f}x"
                                                      if bf16 is not None else ""))


if __name__ == "__main__":
    main()
