"""Typed calls of the GEMM libraries (gemm.c: float32 and GGUF Q4/Q8 panels; gemm_bf16.c: bf16 panels): every GEMM
shares one C signature, y[M, N] = x[M, K] @ W^T (+ bias) over W packed once into the kernel's panels
(layers/gemm_layout.py lays them out), and one wrapper, which with ``PAGEDLLM_NATIVE_CHECKS=1`` checks the rows,
the panels' dtype and shape for that kernel, and the bias before the call."""

from __future__ import annotations

import copy
import ctypes

import torch

from pagedllm.native import checks
from pagedllm.native.checks import expect, require
from pagedllm.native.graph import launch
from pagedllm.native.signature import INT, INT64, POINTER, CFunction, arguments

_GEMM_ARGS = arguments("x", POINTER, "ldx", INT64, "packed", "bias", "y", POINTER, "ldy", INT64, "M", "N", "K",
                       "num_threads", INT)
GEMM_PACKED = CFunction("gemm_packed_f32", INT, *_GEMM_ARGS)
GEMM_QUANT = CFunction("gemm_quant_f32", INT, *_GEMM_ARGS, *arguments("format", INT))
GEMM_AVAILABLE = CFunction("gemm_available", INT)
GEMM_QUANT_AVAILABLE = CFunction("gemm_quant_available", INT)
GEMM_QUANT_BLOCK_SUMS = CFunction("gemm_quant_block_sums", INT, *arguments("format", INT))
MOE_QUANT = CFunction("moe_quant_f32", INT, *arguments("x", "router_logits", "w13", "w13_formats", "w2", "w2_formats",
                                                       "out", POINTER, "tokens", INT64, "hidden", "inter",
                                                       "num_experts", "top_k", "renormalize", "num_threads", INT,
                                                       "bf16_gemm", POINTER, "bf16_min_rows", INT))
DEQUANT_BF16 = CFunction("dequant_bf16_panels", INT, *arguments("packed", "out", POINTER, "N", "K", "num_threads",
                                                                "format", INT))
GEMM_SIGNATURES = (GEMM_PACKED, GEMM_QUANT, GEMM_AVAILABLE, GEMM_QUANT_AVAILABLE, GEMM_QUANT_BLOCK_SUMS, MOE_QUANT,
                   DEQUANT_BF16)
# gemm_quant_f32's formats (gemm_quant.h's enum, the same numbers), by the names of their GEMMs (native.gemm_q4() ...)
QUANT_FORMATS = {"gemm_q4": 0, "gemm_q8": 1, "gemm_q4k": 2, "gemm_q6k": 3, "gemm_q5k": 4, "gemm_iq4nl": 5,
                 "gemm_iq4xs": 6, "gemm_q2k": 7, "gemm_q4kc": 8, "gemm_q6kc": 9, "gemm_q5kc": 10, "gemm_q2kc": 11,
                 "gemm_q3kc": 12}
BF16_MODEL = 0x100  # gemm_quant.h's format flag: a bfloat16 model's layer (Gemm.for_bf16_model)

GEMM_BF16 = CFunction("gemm_bf16", INT, *_GEMM_ARGS)
GEMM_BF16_SILU_MUL = CFunction("gemm_bf16_silu_mul", INT, *_GEMM_ARGS)
GEMM_BF16_AVAILABLE = CFunction("gemm_bf16_available", INT)
GEMM_BF16_USES_AMX = CFunction("gemm_bf16_uses_amx", INT)
MOE_BF16 = CFunction("moe_bf16", INT, *arguments("x", "router_logits", "w13", POINTER, "w13_stride", INT64, "w2",
                                                 POINTER, "w2_stride", INT64, "out", POINTER, "tokens", INT64,
                                                 "hidden", "inter", "num_experts", "first_expert", "held",
                                                 "top_k", "renormalize", "num_threads", INT))
GEMM_BF16_SIGNATURES = (GEMM_BF16, GEMM_BF16_SILU_MUL, GEMM_BF16_AVAILABLE, GEMM_BF16_USES_AMX, MOE_BF16)

GEMM_W8A8 = CFunction("gemm_w8a8_f32", INT, *_GEMM_ARGS)
GEMM_W8A8_SILU_MUL = CFunction("gemm_w8a8_silu_mul_f32", INT, *_GEMM_ARGS)
GEMM_INT8_AVAILABLE = CFunction("gemm_int8_available", INT)
GEMM_INT8_USES_AMX = CFunction("gemm_int8_uses_amx", INT)
GEMM_INT8_SIGNATURES = (GEMM_W8A8, GEMM_W8A8_SILU_MUL, GEMM_INT8_AVAILABLE, GEMM_INT8_USES_AMX)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Per kernel: its panels' dtype and the shape they have for N outputs and K inputs (None: any size). The layouts are
# gemm_layout's pack_*; the gated bf16 panels pad each half to whole 16-column tiles, so only K is fixed for them.
PANELS = {
    GEMM_PACKED.name: (torch.float32, lambda n, k: (_cdiv(n, 64), k, 64)),
    "gemm_q4_f32": (torch.uint8, lambda n, k: (_cdiv(n, 64), k // 32, 1408)),
    "gemm_q4k_f32": (torch.uint8, lambda n, k: (_cdiv(n, 64), k // 32, 1536)),
    "gemm_q4kc_f32": (torch.uint8, lambda n, k: (_cdiv(n, 64), k // 256 * 512 + k // 32 * 1152)),
    "gemm_q6k_f32": (torch.uint8, lambda n, k: (_cdiv(n, 64), k // 16, 1280)),
    "gemm_q6kc_f32": (torch.uint8, lambda n, k: (_cdiv(n, 64), k // 256 * 256 + k // 16 * 832)),
    "gemm_q5kc_f32": (torch.uint8, lambda n, k: (_cdiv(n, 64), k // 256 * 512 + k // 32 * 1408)),
    "gemm_q2kc_f32": (torch.uint8, lambda n, k: (_cdiv(n, 64), k // 256 * 512 + k // 16 * 320)),
    "gemm_q3kc_f32": (torch.uint8, lambda n, k: (_cdiv(n, 64), k // 256 * 256 + k // 16 * 448)),
    "gemm_q5k_f32": (torch.uint8, lambda n, k: (_cdiv(n, 64), k // 32, 2560)),
    "gemm_q2k_f32": (torch.uint8, lambda n, k: (_cdiv(n, 64), k // 16, 1536)),
    "gemm_iq4nl_f32": (torch.uint8, lambda n, k: (_cdiv(n, 64), k // 32, 1152)),
    "gemm_iq4xs_f32": (torch.uint8, lambda n, k: (_cdiv(n, 64), k // 32, 1280)),
    "gemm_q8_f32": (torch.uint8, lambda n, k: (_cdiv(n, 64), k // 32, 2176)),
    GEMM_BF16.name: (torch.bfloat16, lambda n, k: (_cdiv(n, 32), _cdiv(k, 32), 2, 16, 16, 2)),
    GEMM_BF16_SILU_MUL.name: (torch.bfloat16, lambda n, k: (None, _cdiv(k, 32), 2, 16, 16, 2)),
    GEMM_W8A8.name: (torch.uint8, lambda n, k: (_cdiv(n, 16), _cdiv(k, 4) * 64 + 128)),
    GEMM_W8A8_SILU_MUL.name: (torch.uint8, lambda n, k: (_cdiv(n, 16), _cdiv(k, 4) * 64 + 128)),
}


class Gemm:
    """One GEMM kernel of a loaded library; ``quant_format`` (a QUANT_FORMATS name): gemm_quant_f32 over that
    format's panels, named ``<format>_f32``."""

    def __init__(self, lib: ctypes.CDLL, signature: CFunction, quant_format: str | None = None):
        self.name = signature.name if quant_format is None else f"{quant_format}_f32"
        self.lib, self.function = lib, getattr(lib, signature.name)
        self.format_args = () if quant_format is None else (QUANT_FORMATS[quant_format],)

    def for_bf16_model(self) -> "Gemm | None":
        """This quantized GEMM for a bfloat16 model's layer, whose products need not be the float32 dense kernel's bit
        for bit: up to 4 rows then take gemm_quant.h's block sums (tile_quant_sums, fewer vector ops a weight, float32
        rounding of its own order); None where this build has no such path for this format."""
        if not self.format_args or not self.lib.gemm_quant_block_sums(self.format_args[0]):
            return None
        variant = copy.copy(self)
        variant.format_args = (self.format_args[0] | BF16_MODEL,)
        return variant

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                 out_width: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` over ``packed`` (W's panels in this kernel's layout), for float32 ``x`` ``[..., K]``;
        with ``out_width``, what a kernel writing that many columns per row makes of it (gemm_bf16_silu_mul).
        Called ~120 times a decode step: it keeps to the few tensor calls it needs."""
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        num_rows, in_features = rows.shape
        width = out_width or out_features
        given = out is not None
        if not given:
            out = rows.new_empty(num_rows, width)
        if bias is not None:
            bias = bias.contiguous()
        if checks.ENABLED:
            self._check(rows, packed, bias, out_features)
            require(self.name, out.shape == (num_rows, width) and out.stride(1) == 1 and out.dtype == torch.float32,
                    f"out {tuple(out.shape)} (strides {out.stride()}) must be float32 [{num_rows}, {width}] rows")
        status = launch(self.function, rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), num_rows,
                        out_features, in_features, torch.get_num_threads(), *self.format_args)
        if status != 0:
            raise RuntimeError(f"{self.name} rejected its sizes (status {status})")
        return out if x.dim() == 2 or given else out.view(*x.shape[:-1], width)

    def _check(self, rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> None:
        dtype, shape = PANELS[self.name]
        expect(self.name, "x", rows, torch.float32)
        expect(self.name, "packed", packed, dtype, shape(out_features, rows.shape[1]), contiguous=True)
        if self.format_args:
            block = 256 if self.name.endswith("kc_f32") else 16 if self.name in ("gemm_q6k_f32", "gemm_q2k_f32") else 32
            require(self.name, rows.shape[1] % block == 0, f"K = {rows.shape[1]} is not whole blocks of {block}")
        if bias is not None:
            expect(self.name, "bias", bias, torch.float32, (out_features,), contiguous=True)


class DequantBf16:
    """dequant_bf16_panels: a quantized weight's panels (in the format of ``kernel``, the quantized Gemm whose panels
    they are) as gemm_bf16's, written into ``out`` (PANELS[GEMM_BF16.name]'s shape for ``out_features`` x
    ``in_features``)."""

    def __init__(self, lib: ctypes.CDLL):
        self.function = lib.dequant_bf16_panels

    def __call__(self, packed: torch.Tensor, out: torch.Tensor, out_features: int, in_features: int,
                 kernel: Gemm) -> torch.Tensor:
        if checks.ENABLED:
            expect(DEQUANT_BF16.name, "out", out, torch.bfloat16,
                   PANELS[GEMM_BF16.name][1](out_features, in_features), contiguous=True)
        status = launch(self.function, packed.data_ptr(), out.data_ptr(), out_features, in_features,
                        torch.get_num_threads(), *kernel.format_args)
        if status != 0:
            raise RuntimeError(f"{DEQUANT_BF16.name} rejected its arguments or had no scratch (status {status})")
        return out


def _check_moe_status(name: str, status: int) -> None:
    """A native MoE layer's status: -2 its scratch could not be had, other non-zero values rejected arguments."""
    if status == -2:
        raise MemoryError(f"{name} could not allocate its scratch")
    if status != 0:
        raise RuntimeError(f"{name} rejected its arguments (status {status})")


def moe_quant(lib: ctypes.CDLL, x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
              w13_formats: torch.Tensor, w2: torch.Tensor, w2_formats: torch.Tensor, inter: int, top_k: int,
              renormalize: bool, bf16_gemm: int | None = None, bf16_min_rows: int = 0) -> torch.Tensor:
    """moe_quant_f32: a mixture-of-experts layer's output ``[T, hidden]`` for float32 ``x`` and its router's logits
    ``[T, experts]``, the experts' panels given by address: ``w13`` ``[experts, 2]`` int64 (the ``[gate | up]``
    panels and 0, or the gate's and the up's), ``w2`` ``[experts]``, their formats (QUANT_FORMATS' numbers) in int32
    tables alike. ``bf16_gemm``: gemm_bf16's address (native.gemm_bf16_address), through which an expert of
    ``bf16_min_rows`` rows or more multiplies its projections dequantized to bf16 panels."""
    experts = w2.shape[0]
    if checks.ENABLED:
        require(MOE_QUANT.name, x.dim() == 2 and x.is_contiguous() and x.dtype == torch.float32 and
                router_logits.shape == (x.shape[0], experts) and router_logits.is_contiguous() and
                w13.shape == (experts, 2) and w13_formats.shape == (experts, 2) and w2_formats.shape == (experts,),
                f"x {tuple(x.shape)}, logits {tuple(router_logits.shape)}, tables {tuple(w13.shape)} / "
                f"{tuple(w2.shape)} do not fit")
    out = torch.empty_like(x)
    status = launch(lib.moe_quant_f32, x.data_ptr(), router_logits.data_ptr(), w13.data_ptr(), w13_formats.data_ptr(),
                    w2.data_ptr(), w2_formats.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], inter, experts,
                    top_k, int(renormalize), torch.get_num_threads(), bf16_gemm, bf16_min_rows)
    _check_moe_status(MOE_QUANT.name, status)
    return out


def moe_bf16(lib: ctypes.CDLL, x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             inter: int, top_k: int, renormalize: bool, first_expert: int = 0) -> torch.Tensor:
    """moe_bf16: a mixture-of-experts layer's output ``[T, hidden]`` for float32 ``x`` and its router's logits
    ``[T, experts]``, from the experts held here in gemm_bf16's panels (``first_expert`` onwards, all of them but on
    an expert-parallel rank): ``w13`` ``[held, ...]`` each one's gated ``[gate | up]`` (pack_bf16_panels(gated=True)),
    ``w2`` ``[held, ...]`` its down."""
    held = w2.shape[0]
    if checks.ENABLED:
        require(MOE_BF16.name, x.dim() == 2 and x.is_contiguous() and x.dtype == torch.float32 and
                router_logits.dim() == 2 and router_logits.shape[0] == x.shape[0] and
                0 <= first_expert <= router_logits.shape[1] - held and router_logits.is_contiguous() and
                w13.shape[0] == held and w13.dtype == w2.dtype == torch.bfloat16 and w13.is_contiguous() and
                w2.is_contiguous(), f"x {tuple(x.shape)}, logits {tuple(router_logits.shape)}, panels "
                f"{tuple(w13.shape)} / {tuple(w2.shape)} do not fit")
    out = torch.empty_like(x)
    status = launch(lib.moe_bf16, x.data_ptr(), router_logits.data_ptr(), w13.data_ptr(), w13[0].numel(),
                    w2.data_ptr(), w2[0].numel(), out.data_ptr(), x.shape[0], x.shape[1], inter,
                    router_logits.shape[1], first_expert, held, top_k, int(renormalize), torch.get_num_threads())
    _check_moe_status(MOE_BF16.name, status)
    return out
