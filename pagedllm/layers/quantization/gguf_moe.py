"""GGUF experts kept packed: a mixture-of-experts layer whose ``_exps`` stacks are of packed kinds (Qwen3-30B-A3B's
Q4_K gate/up and Q6_K down, as a Q4_K_M file has them) holds each expert's projections in gemm.c's quantized panels
instead of float32 stacks three to six times their size.

The loader yields each expert's codes, scales and zeros (models/gguf_loader.py) and each part is cut to this rank's
slice as it arrives; once a projection's parts are all in, they are packed into its panels and dropped, so loading
never holds more than one layer's unpacked codes. An expert's gate and up become one ``[gate | up]`` weight where both
are one kind and the gate fills whole panels (else two, each writing its half of the output). A step routes as the
dense layer does and runs each active expert once over its tokens through its panels, in one native call
(native/moe_quant.c) where every expert is on this rank, so a CPU graph can replay the step, else in torch
(fused_moe.routed_experts); results equal the dense experts' on the dequantized weights up to the order of float32
sums. In a bfloat16 model on AMX the native layer's experts with BF16_MIN_ROWS rows or more in a step multiply as
the model's dense quantized layers then do: dequantized to bf16 panels, on the tiles (rows rounded to bf16).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.fused_moe import FusedMoE, routed_experts, select_experts
from pagedllm.layers.gemm_layout import BF16_MIN_ROWS, PANEL, QuantizedWeight, WeightLayout
from pagedllm.layers.quantization.gguf_linear import GGUFLinearMethod
from pagedllm import native
from pagedllm.native.gemms import moe_quant

PROJECTIONS = {"w13": ("w1", "w3"), "w2": ("w2",)}  # FusedMoE's parameters and the shards each stacks
_SILU_AND_MUL = SiluAndMul()


class GGUFFusedMoEMethod:
    """``methods``: per shard (``w1`` gate, ``w2`` down, ``w3`` up) the GGUF linear method of its stack's kind,
    whose ``pack`` lays its parts out and whose ``block_params`` name them."""

    def __init__(self, methods: dict[str, type[GGUFLinearMethod]]):
        self.methods = methods
        self.pending: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # (local expert, shard) -> parts so far
        self.packed: dict[tuple[int, str], QuantizedWeight] = {}
        # Per local expert, after loading: the [gate | up] weights with the column each writes from, and the down.
        self.w13: list[list[tuple[int, QuantizedWeight]]] = []
        self.w2: list[QuantizedWeight] = []
        self.bf16_gemm: int | None = None  # gemm_bf16's address, where long steps multiply on bf16 panels (AMX)

    def create_weights(self, layer: FusedMoE) -> None:
        """Empty parameters named as the loader's parts (``w13_qweight``, ``w13_scales``, ...), so that loading
        fills and checks them by name as any other; their weight_loader packs instead of storing."""
        inter = layer.intermediate_size_per_partition
        down = self.methods["w2"]  # a rank's slice of the intermediate dim cuts the down projection's inputs
        if layer.num_local_experts == layer.num_experts and layer.tp_size > 1 and inter % down.block:
            raise ValueError(f"{down.__name__} experts need the intermediate size per rank to be a multiple of "
                             f"{down.block}; got {inter}")
        for name, shards in PROJECTIONS.items():
            for part in dict.fromkeys(p for s in shards for p in ("qweight", *self.methods[s].block_params)):
                param = nn.Parameter(torch.empty(0), requires_grad=False)
                param.part, param.weight_loader = part, self._loader(layer)
                layer.register_parameter(f"{name}_{part}", param)

    def _loader(self, layer: FusedMoE):
        def weight_loader(param: nn.Parameter, loaded: torch.Tensor, expert_id: int, shard_id: str) -> None:
            local = layer.local_expert(expert_id)
            if local is None:
                return
            method = self.methods[shard_id]
            per_input = 1 if param.part == "qweight" else method.block
            parts = self.pending.setdefault((local, shard_id), {})
            parts[param.part] = layer.rank_slice(loaded, shard_id, per_input).contiguous()
            names = ("qweight", *method.block_params)
            if all(name in parts for name in names):
                del self.pending[(local, shard_id)]
                self.packed[(local, shard_id)] = method.pack([parts[name] for name in names], None)

        return weight_loader

    def process_weights_after_loading(self, layer: FusedMoE, layout: WeightLayout | None = None) -> None:
        missing = sorted({f"expert {layer.first_expert + e} {s}" for e in range(layer.num_local_experts)
                          for s in self.methods if (e, s) not in self.packed})
        if missing:
            raise ValueError(f"GGUF experts incomplete after loading: {', '.join(missing[:4])}")
        inter = layer.intermediate_size_per_partition
        for expert in range(layer.num_local_experts):
            gate, up, down = (self.packed.pop((expert, s)) for s in ("w1", "w3", "w2"))
            if gate.kernel.name == up.kernel.name and inter % PANEL == 0:  # whole panels: [gate | up] is one weight
                gate = QuantizedWeight(gate.kernel.name.removesuffix("_f32"), torch.cat([gate.panels, up.panels]),
                                       2 * inter)
                self.w13.append([(0, gate)])
            else:
                self.w13.append([(0, gate), (inter, up)])
            self.w2.append(down)
            if layout is not None:
                for weight in (*(w for _, w in self.w13[-1]), down):
                    weight.panels = layout.place(weight.panels)
                    if layout.bf16_panels:  # a bfloat16 model: decode rows by block sums, as its dense layers'
                        weight.kernel = weight.kernel.for_bf16_model() or weight.kernel
        for name in [name for name, _ in layer.named_parameters(recurse=False)]:
            delattr(layer, name)
        if layout is not None and layout.quantized_steps_on_amx():
            self.bf16_gemm = native.gemm_bf16_address()
        # The native layer's tables: each expert's panels by address (a merged [gate | up] and 0, or the gate's and
        # the up's) and formats; the weights above keep the panels alive.
        w13 = [[w for _, w in shards] for shards in self.w13]
        self.w13_table = torch.tensor([[w.panels.data_ptr() for w in pair] + [0] * (2 - len(pair)) for pair in w13])
        self.w13_formats = torch.tensor([[w.kernel.format_args[0] for w in pair] + [0] * (2 - len(pair))
                                         for pair in w13], dtype=torch.int32)
        self.w2_table = torch.tensor([w.panels.data_ptr() for w in self.w2])
        self.w2_formats = torch.tensor([w.kernel.format_args[0] for w in self.w2], dtype=torch.int32)

    def expert_mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """One expert's SiLU-gated MLP over its ``rows`` (float32)."""
        gate_up = rows.new_empty(rows.shape[0], sum(weight.out_features for _, weight in self.w13[expert]))
        for column, weight in self.w13[expert]:
            weight.linear(rows, None, out=gate_up[:, column:column + weight.out_features])
        return self.w2[expert].linear(_SILU_AND_MUL(gate_up))

    def runs_natively(self, layer: FusedMoE) -> bool:
        """Whether a step is one native call (moe_quant_f32: every expert on this rank, float32 activations)."""
        return (native.moe_quant() is not None and layer.num_local_experts == layer.num_experts
                and layer.tp_size == 1 and layer.params_dtype == torch.float32)

    def apply(self, layer: FusedMoE, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.runs_natively(layer) and hidden_states.dtype == torch.float32:
            return moe_quant(native.moe_quant(), hidden_states.contiguous(), router_logits.float().contiguous(),
                             self.w13_table, self.w13_formats, self.w2_table, self.w2_formats,
                             layer.intermediate_size_per_partition, layer.top_k, layer.renormalize, self.bf16_gemm,
                             BF16_MIN_ROWS)
        topk_weights, topk_ids = select_experts(router_logits, layer.top_k, layer.renormalize)
        return routed_experts(hidden_states, topk_weights, topk_ids, layer.num_local_experts, self.expert_mlp,
                              layer.first_expert)
