"""``quantization="int8"``: W8A8 as vLLM's CPU W8A8, dynamic per-token activations, with outliers kept out.

Each linear layer's weight is quantized at load, from whatever checkpoint filled it (safetensors, .bin or GGUF,
dequantized), symmetric per output channel: ``sw = max|W[n]| / 127``, codes ``round(W / sw)``. At run time each row
of the input is quantized the same way per token, but for its OUTLIERS_PER_ROW entries of largest magnitude, which
stay float32 (LLM.int8()'s outlier decomposition, per token): ``sx = max|x| / 127`` over the other entries, the codes
multiply in int32, the outliers multiply their columns' weight codes in float, and the output is (acc * sx + outlier
terms) * sw (+ bias). vLLM codes every entry; a few entries of the residual stream are tens of times the others, and
a scale set by them leaves the others a handful of codes: SmolLM2's teacher-forced greedy agreement with float32 is
0.89 that way, 0.95-0.97 with two entries a token kept out (docs/benchmarks.md). On CPUs with AVX2 (summing by VNNI
where they have it) the native kernel (native/gemm_int8.c) does all of it in one call, quantizing the rows as they
come in; elsewhere torch's int8 matmul (``torch._int_mm``) does the products after the same quantization in torch,
with the same results up to float rounding in the epilogue. The embedding and the LM head stay dense (as vLLM keeps
them); so do a mixture of experts' experts and router.

A checkpoint already quantized so (compressed-tensors' W8A8: int8 ``weight`` and a per-channel ``weight_scale``,
activations dynamic per token, as llm-compressor writes it) loads its codes and scales as they are, into the same
kernels; the layers its config groups do not target, or its ``ignore`` list names, stay dense.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import native
from pagedllm.layers.gemm_layout import QuantizedWeight, WeightLayout
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.base import QuantizationConfig, QuantizeMethodBase, checkpoint_modules

PANEL_COLUMNS = 16  # gemm_int8.c's columns per panel
K_GROUP = 4  # consecutive inputs per vpdpbusd lane
OUTLIERS_PER_ROW = 2  # gemm_int8.c's OUTLIERS


def quantize_symmetric(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of float32 ``values`` -> int8 codes in [-127, 127] and each row's float32 scale (max|row| / 127; a row
    of zeros gets scale 0 and codes 0), by the kernel's arithmetic: codes = rint(v * (127 / max|row|))."""
    amax = values.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(values * inverse).clamp_(-127, 127).to(torch.int8)
    return codes, (amax / 127.0).squeeze(-1)


def quantize_activations(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``[M, K]`` of float32 activations as the W8A8 kernel takes them: each row's OUTLIERS_PER_ROW entries of
    largest |x|, their indices and values ``[M, OUTLIERS_PER_ROW]`` (fewer where K is smaller), kept out; the rest
    as ``quantize_symmetric`` codes them (the outliers' codes 0), with the row's scale."""
    ids = rows.abs().topk(min(OUTLIERS_PER_ROW, rows.shape[-1]), dim=-1).indices
    codes, scales = quantize_symmetric(rows.scatter(-1, ids, 0.0))
    return codes, scales, ids, rows.gather(-1, ids)


def outlier_terms(ids: torch.Tensor, values: torch.Tensor, weight_codes: torch.Tensor) -> torch.Tensor:
    """``[M, N]``: each row's outliers (``quantize_activations``) times their columns of ``weight_codes`` ``[N, K]``,
    summed."""
    return torch.einsum("mo,mon->mn", values, weight_codes.t()[ids].float())


def gate_up_interleaved(rows: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """A gated projection's ``[gate; up]`` rows (or scales), gate and up alternating 16 at a time: the order of
    gemm_w8a8_silu_mul_f32's panels; ``inverse``: back from that order."""
    blocks = rows.shape[0] // (2 * PANEL_COLUMNS)
    split = (blocks, 2) if inverse else (2, blocks)
    return rows.reshape(*split, PANEL_COLUMNS, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


def pack_w8a8_panels(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` int8 codes and ``[N]`` scales -> gemm_w8a8_f32's panels, ``[ceil(N / 16), ceil(K / 4) * 64 + 128]``
    bytes: per panel of 16 columns, ceil(K / 4) groups of the 16 columns' 4 consecutive codes, then the columns'
    scales (float32) and 128 * their code sums (int32), which the kernel takes back off its unsigned-activation
    sums. Padding columns and inputs are zero codes."""
    n, k = codes.shape
    n_pad, k_pad = -n % PANEL_COLUMNS, -k % K_GROUP
    codes = F.pad(codes, (0, k_pad, 0, n_pad))
    panels = (n + n_pad) // PANEL_COLUMNS
    groups = codes.view(panels, PANEL_COLUMNS, -1, K_GROUP).permute(0, 2, 1, 3).reshape(panels, -1)
    scales = F.pad(scales.float(), (0, n_pad)).view(panels, PANEL_COLUMNS)
    compensation = (128 * codes.sum(dim=1, dtype=torch.int32)).view(panels, PANEL_COLUMNS)
    return torch.cat([groups.view(torch.uint8), scales.contiguous().view(torch.uint8),
                      compensation.contiguous().view(torch.uint8)], dim=1).contiguous()


class Int8LinearMethod(QuantizeMethodBase):
    """Loads a dense weight like the unquantized method (so tensor-parallel loaders slice it as usual), or with
    ``checkpoint_quantized`` the checkpoint's int8 ``weight`` and ``weight_scale`` (``[out]``: the layers' loaders
    cut it as a bias, by output); then keeps only codes and scales: the native kernel's panels, or ``[N, K]`` codes
    for torch's int8 matmul."""

    def __init__(self, checkpoint_quantized: bool = False):
        self.checkpoint_quantized = checkpoint_quantized
        self.packed: QuantizedWeight | None = None  # the native kernel's panels, where it applies
        # The panels alternate a gated MLP's gate and up columns, for silu_and_mul's fused kernel (as the layout's
        # fused_silu asks, for a layer without a bias whose halves are whole panels).
        self.gated = False

    def create_weights(self, layer, input_size_per_partition, output_size_per_partition, params_dtype,
                       weight_loader):
        dtype = torch.int8 if self.checkpoint_quantized else params_dtype
        weight = nn.Parameter(torch.empty(output_size_per_partition, input_size_per_partition, dtype=dtype),
                              requires_grad=False)
        weight.weight_loader = weight_loader
        layer.register_parameter("weight", weight)
        if self.checkpoint_quantized:
            scale = nn.Parameter(torch.empty(output_size_per_partition, dtype=torch.float32), requires_grad=False)
            # compressed-tensors keeps [out, 1]
            scale.weight_loader = lambda param, loaded, *shard: weight_loader(param, loaded.reshape(-1), *shard)
            layer.register_parameter("weight_scale", scale)

    def process_weights_after_loading(self, layer, layout: WeightLayout | None = None) -> None:
        if self.checkpoint_quantized:
            codes, scales = layer.weight.data, layer.weight_scale.data.float()
            del layer.weight_scale
        else:
            codes, scales = quantize_symmetric(layer.weight.data.float())
        del layer.weight
        if layer.params_dtype == torch.float32 and native.gemm_w8a8() is not None:
            self.gated = (getattr(layer, "gated_silu", False) and layout is not None and layout.fused_silu
                          and layer.bias is None and codes.shape[0] % (2 * PANEL_COLUMNS) == 0)
            if self.gated:
                codes, scales = gate_up_interleaved(codes), gate_up_interleaved(scales)
            self.packed = QuantizedWeight.w8a8(pack_w8a8_panels(codes, scales), codes.shape[0], layout)
            layer.weight = nn.Parameter(self.packed.panels, requires_grad=False)
            return
        layer.weight = nn.Parameter(codes, requires_grad=False)
        layer.weight_scale = nn.Parameter(scales, requires_grad=False)

    def apply(self, layer, x, bias=None):
        if self.packed is not None:
            y = self.packed.linear(x, bias)
            if self.gated:  # back to [gate | up] from the panels' alternation (a gate_up output asked for whole)
                y = gate_up_interleaved(y.reshape(-1, y.shape[-1]).t(), inverse=True).t().reshape(y.shape)
            return y
        rows = x.reshape(-1, x.shape[-1]).float()
        codes, row_scales, ids, values = quantize_activations(rows)
        acc = torch._int_mm(codes, layer.weight.t())
        y = (acc.float() * row_scales.unsqueeze(-1) + outlier_terms(ids, values, layer.weight)) * layer.weight_scale
        if bias is not None:
            y = y + bias
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    def apply_silu_and_mul(self, layer, x, bias=None):
        if not self.gated:
            return None
        out_features = self.packed.out_features
        return native.gemm_w8a8_silu_mul()(x, self.packed.panels, None, out_features, out_width=out_features // 2)


def matches_module(name: str, pattern: str) -> bool:
    """Whether a compressed-tensors ``ignore`` or ``targets`` entry names module ``name``: ``re:`` a regular
    expression matched from the name's start (re.match, as compressed-tensors' match_name and vLLM read it:
    ``re:.*mlp`` names every module under an MLP), else the name itself."""
    return re.match(pattern[3:], name) is not None if pattern.startswith("re:") else pattern == name


class Int8Config(QuantizationConfig):
    """Every linear layer W8A8, quantized at load; or, ``checkpoint_quantized``, as the checkpoint has it: the layers
    its config groups' ``targets`` name but its ``ignore`` list does not (module names or ``re:`` patterns, matched
    against the checkpoint's modules behind a fused layer, ``stacked_params_mapping`` saying which; a target may name
    a module class instead, ``Linear`` every linear layer)."""

    def __init__(self, checkpoint_quantized: bool = False, ignore: Sequence[str] = (),
                 stacked_params_mapping: list[tuple[str, str, object]] = (), targets: Sequence[str] = ("Linear",)):
        self.checkpoint_quantized = checkpoint_quantized
        self.ignore = list(ignore)
        self.stacked_params_mapping = list(stacked_params_mapping)
        self.targets = list(targets)

    @classmethod
    def from_compressed_tensors(cls, quantization_config: dict,
                                stacked_params_mapping: list[tuple[str, str, object]]) -> "Int8Config":
        """The config of a compressed-tensors checkpoint whose every scheme is W8A8 int8 with symmetric per-channel
        weights and dynamic symmetric per-token activations; a ValueError naming what differs otherwise, before any
        weight is read: a sparsity_config with targets too, as vLLM's refuses it (sparse checkpoints no longer run).
        As vLLM's CompressedTensorsConfig.from_config, a group whose one target is an attention module (its q/k/v
        activations', which vLLM takes as the kv_cache_scheme's) is skipped, and without any other group no linear
        layer is quantized (a checkpoint of fp8 KV cache scales only)."""
        sparsity = quantization_config.get("sparsity_config") or {}
        if sparsity.get("targets"):
            raise ValueError(f"compressed-tensors sparsity_config (format {sparsity.get('format')!r}, targets "
                             f"{sparsity['targets']}) is not supported: sparse checkpoints do not run, as in vLLM")
        groups = {name: group for name, group in (quantization_config.get("config_groups") or {}).items()
                  if not (len(group.get("targets") or ()) == 1 and group["targets"][0].endswith("Attention"))}
        fmt = quantization_config.get("format")
        if groups and fmt != "int-quantized":
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported; only 'int-quantized' (W8A8 int8)")
        for name, group in groups.items():
            weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
            if (weights.get("num_bits"), weights.get("type"), weights.get("symmetric"), weights.get("strategy")) != (
                    8, "int", True, "channel"):
                raise ValueError(f"compressed-tensors group {name!r}: weights must be 8-bit int, symmetric, per "
                                 f"channel; got {weights}")
            if (inputs.get("num_bits"), inputs.get("type"), inputs.get("symmetric"), inputs.get("dynamic"),
                    inputs.get("strategy")) != (8, "int", True, True, "token"):
                raise ValueError(f"compressed-tensors group {name!r}: input activations must be 8-bit int, "
                                 f"symmetric, dynamic per token; got {inputs}")
        targets = [target for group in groups.values() for target in group.get("targets") or ()]
        return cls(True, quantization_config.get("ignore") or (), stacked_params_mapping, targets)

    def _listed(self, prefix: str, entries: list[str], field: str, verb: str) -> bool:
        """Whether ``entries`` (the ``ignore`` or ``targets`` list) name layer ``prefix``: itself, or, for a layer
        fused here, all of its checkpoint parts; a list that names some parts only is an error (one layer, one
        scheme)."""
        def listed(name: str) -> bool:
            return any(matches_module(name, entry) for entry in entries)

        if listed(prefix):
            return True
        names = checkpoint_modules(prefix, self.stacked_params_mapping)
        parts = [listed(name) for name in names]
        if any(parts) and not all(parts):
            raise ValueError(f"compressed-tensors {field}: {prefix} fuses {', '.join(names)}, which must be "
                             f"{verb} all together or not at all")
        return all(parts)

    def _targeted(self, layer: nn.Module, prefix: str) -> bool:
        """Whether a config group targets layer ``prefix``: by its class, as vLLM reads a target that is no ``re:``
        pattern (contained in the class's name, so ``Linear`` names every linear layer), or by name."""
        kind = type(layer).__name__.lower()
        return (any(not target.startswith("re:") and target.lower() in kind for target in self.targets)
                or self._listed(prefix, self.targets, "targets", "targeted"))

    def get_quant_method(self, layer, prefix):
        if (not isinstance(layer, LinearBase) or self._listed(prefix, self.ignore, "ignore list", "ignored")
                or not self._targeted(layer, prefix)):
            return None
        return Int8LinearMethod(self.checkpoint_quantized)
