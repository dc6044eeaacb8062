"""Linear layers that know how to hold one tensor-parallel rank's slice.

Each layer stores only its rank's part of the weight and exposes
``weight_loader(param, loaded_weight[, shard_id])`` that cuts that part out of
a full checkpoint tensor, so models load the same way for any ``tp_size``.
Column-parallel layers split the output dim (no communication); row-parallel
layers split the input dim and sum partial results with an all-reduce.
How the weight is stored and multiplied is the layer's ``quant_method``: a
dense ``weight`` by default, or what a ``QuantizationConfig`` picks for it.
"""

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.communication_op import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from pagedllm.layers.gemm_layout import DenseWeight, WeightLayout
from pagedllm.layers.quantization.base import QuantizationConfig, QuantizeMethodBase
from pagedllm.lora.punica import add_lora, lora_active


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by tp_size {denominator}")
    return numerator // denominator


def _shard(loaded_weight: torch.Tensor, dim: int, full: int, start: int, size: int) -> torch.Tensor:
    """``loaded_weight``'s [start, start + size) along ``dim``, once it is checked to be ``full`` long there: a
    checkpoint tensor larger than its config implies would otherwise be cut to size without a word."""
    if loaded_weight.shape[dim] != full:
        raise ValueError(f"weight shape mismatch: expected {full} along dimension {dim}, got "
                         f"{tuple(loaded_weight.shape)}")
    return loaded_weight.narrow(dim, start, size)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight shape mismatch: expected {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


class UnquantizedLinearMethod(QuantizeMethodBase):
    """A dense ``[out_per_rank, in_per_rank]`` weight in the layer's dtype."""

    def create_weights(self, layer, input_size_per_partition, output_size_per_partition, params_dtype,
                       weight_loader):
        weight = nn.Parameter(
            torch.empty(output_size_per_partition, input_size_per_partition, dtype=params_dtype), requires_grad=False
        )
        weight.weight_loader = weight_loader
        layer.register_parameter("weight", weight)

    def __init__(self):
        self.dense: DenseWeight | None = None  # set once the weights are loaded

    def apply(self, layer, x, bias=None):
        if self.dense is None:
            return F.linear(x, layer.weight, bias)
        return self.dense.linear(x, bias)

    def apply_silu_and_mul(self, layer, x, bias=None):
        return self.dense.silu_and_mul(x, bias) if self.dense is not None and self.dense.gated else None

    def process_weights_after_loading(self, layer, layout: WeightLayout | None = None) -> None:
        """Lay the weight out for its GEMMs (layers/gemm_layout.py); the parameter then holds its one copy: the
        panels where a native kernel takes them, else the torch layout."""
        self.dense = DenseWeight(layer.weight.data, gated=getattr(layer, "gated_silu", False), layout=layout)
        layer.weight.data = self.dense.data if self.dense.data is not None else self.dense.panels


class LinearBase(nn.Module):
    """Holds this rank's weight (in its ``quant_method``'s layout) and optional bias.

    ``prefix`` is the module's name in the model, by which a quantization config
    finds the checkpoint tensors behind it.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype | None,
        tp_size: int,
        tp_rank: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
        self.input_size = input_size
        self.output_size = output_size
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.params_dtype = params_dtype or torch.get_default_dtype()
        quant_method = quant_config.get_quant_method(self, prefix) if quant_config else None
        self.quant_method = quant_method or UnquantizedLinearMethod()
        # The adapter slots of multi-LoRA serving (lora/layers.LinearLoRA), attached by the worker's LoRA manager;
        # while a step has adapters, forward adds their x·A·B to the rows that use them.
        self.lora = None


    def _create_params(self, out_features: int, in_features: int, bias: bool) -> None:
        self.quant_method.create_weights(self, in_features, out_features, self.params_dtype, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=self.params_dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
            f"tp_size={self.tp_size}, tp_rank={self.tp_rank}"
        )


class ReplicatedLinear(LinearBase):
    """Full weight on every rank."""

    def __init__(self, input_size, output_size, bias=True, params_dtype=None, tp_size=1, tp_rank=0,
                 quant_config=None, prefix=""):
        super().__init__(input_size, output_size, params_dtype, tp_size, tp_rank, quant_config, prefix)
        self._create_params(output_size, input_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        _copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Y = XA with A split by output columns; each rank computes its slice of Y."""

    def __init__(
        self,
        input_size,
        output_size,
        bias=True,
        gather_output=False,
        params_dtype=None,
        tp_size=1,
        tp_rank=0,
        quant_config=None,
        prefix="",
    ):
        super().__init__(input_size, output_size, params_dtype, tp_size, tp_rank, quant_config, prefix)
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, tp_size)
        self._create_params(self.output_size_per_partition, input_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard = param.shape[0]
        _copy_checked(param.data, _shard(loaded_weight, 0, shard * self.tp_size, self.tp_rank * shard, shard))

    def _load_fused(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_sizes: dict) -> None:
        """A checkpoint tensor holding the outputs this layer fuses already stacked as it stacks them (Phi-3's
        qkv_proj and gate_up_proj; vLLM's loaders take it as shard id None): cut into the full outputs, shard id
        to size in order, each loaded as its own checkpoint tensor, so each rank still takes its slice of each."""
        for shard_id, part in zip(shard_sizes, loaded_weight.split(list(shard_sizes.values())), strict=True):
            self.weight_loader(param, part, shard_id)

    def output_shards(self) -> list[tuple[int, int, int]]:
        """Per output of the checkpoint this layer fuses: (offset in this rank's output, size on this rank, which
        of the full output's equal shards this rank holds). How the weight_loader cuts weights, and the LoRA
        slots their B."""
        return [(0, self.output_size_per_partition, self.tp_rank)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = add_lora(self.lora, self.quant_method.apply(self, x, self.bias), x)
        if self.gather_output and self.tp_size > 1:
            y = tensor_model_parallel_all_gather(y)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs (e.g. gate and up) fused into one matmul.

    Each rank's weight is ``[shard_0 slice, shard_1 slice, ...]`` stacked. ``gated_silu``: the two outputs are a
    gated MLP's gate and up, which ``silu_and_mul`` may then compute with the activation fused in.
    """

    def __init__(self, input_size, output_sizes: list[int], bias=True, gather_output=False,
                 params_dtype=None, tp_size=1, tp_rank=0, quant_config=None, prefix="", gated_silu: bool = False):
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            divide(size, tp_size)  # each part must split evenly, not just their sum
        if gated_silu and (len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]):
            raise ValueError(f"gated_silu needs two equal outputs (gate, up), got {self.output_sizes}")
        super().__init__(input_size, sum(output_sizes), bias, gather_output, params_dtype, tp_size, tp_rank,
                         quant_config, prefix)
        self.gated_silu = gated_silu

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of this projection in one kernel where the weight's layout has one (gated bf16 or
        int8 panels), else None (then apply the activation to ``forward``'s output)."""
        if not self.gated_silu or self.gather_output or lora_active(self.lora):
            return None  # (adapters add to the projection before the activation)
        return self.quant_method.apply_silu_and_mul(self, x, self.bias)

    def output_shards(self) -> list[tuple[int, int, int]]:
        return [(sum(self.output_sizes[:i]) // self.tp_size, size // self.tp_size, self.tp_rank)
                for i, size in enumerate(self.output_sizes)]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int | None = None
                      ) -> None:
        if loaded_shard_id is None:
            return self._load_fused(param, loaded_weight, dict(enumerate(self.output_sizes)))
        offset, size, shard_rank = self.output_shards()[loaded_shard_id]
        _copy_checked(param.data.narrow(0, offset, size), _shard(loaded_weight, 0, self.output_sizes[loaded_shard_id],
                                                                 shard_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by attention heads.

    With more ranks than KV heads, each KV head is replicated on
    ``tp_size // total_num_kv_heads`` consecutive ranks.
    """

    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads=None, bias=True,
                 params_dtype=None, tp_size=1, tp_rank=0, quant_config=None, prefix=""):
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias, False, params_dtype, tp_size, tp_rank, quant_config, prefix)

    def output_shards(self) -> list[tuple[int, int, int]]:
        """q, k, v; with more ranks than KV heads, a rank holds KV head tp_rank // replicas."""
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        return [(0, q_size, self.tp_rank), (q_size, kv_size, kv_rank), (q_size + kv_size, kv_size, kv_rank)]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str | None = None
                      ) -> None:
        if loaded_shard_id is None:
            q_size, kv_size = self.total_num_heads * self.head_size, self.total_num_kv_heads * self.head_size
            return self._load_fused(param, loaded_weight, {"q": q_size, "k": kv_size, "v": kv_size})
        offset, size, shard_rank = self.output_shards()["qkv".index(loaded_shard_id)]
        heads = self.total_num_heads if loaded_shard_id == "q" else self.total_num_kv_heads
        _copy_checked(param.data.narrow(0, offset, size),
                      _shard(loaded_weight, 0, heads * self.head_size, shard_rank * size, size))


class RowParallelLinear(LinearBase):
    """Y = XA with A split by input rows; partial results are summed across ranks.

    The bias is added once (rank 0) before the all-reduce.
    """

    def __init__(self, input_size, output_size, bias=True, input_is_parallel=True, reduce_results=True,
                 params_dtype=None, tp_size=1, tp_rank=0, quant_config=None, prefix=""):
        super().__init__(input_size, output_size, params_dtype, tp_size, tp_rank, quant_config, prefix)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, tp_size)
        self._create_params(output_size, self.input_size_per_partition, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.dim() == 2:
            shard = param.shape[1]
            loaded_weight = _shard(loaded_weight, 1, shard * self.tp_size, self.tp_rank * shard, shard)
        _copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            shard = self.input_size_per_partition
            x = x.narrow(-1, self.tp_rank * shard, shard)
        # This rank's part of x·A·B joins its partial output, so the one all-reduce sums both.
        y = add_lora(self.lora, self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None), x)
        if self.reduce_results and self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        return y
