"""Weights laid out once, after loading, for the CPU GEMMs that multiply by them (the idea of vLLM's
``dispatch_cpu_unquantized_gemm``).

float32 on CPU: MKL's sgemm repacks the weight on every call, which at decode sizes costs about as much as the
multiply. So a dense float32 weight is packed once into the native kernel's panels (native/gemm.c, AVX-512 or
AVX2), its only copy, which serve batches of every size: at prefill sizes MKL is at most a few percent ahead, not
worth holding every weight twice (as vLLM's CPU GEMM dispatch also keeps one packed copy). Without the kernel, MKL
multiplies an input-major copy (``W.T`` stored row-major, far faster at 8-64 rows than transposing ``W`` on the
fly). A bfloat16 model on a CPU with bf16 arithmetic lays its dense weights out as gemm_bf16.c's bf16 panels
instead, also its only copy. Other dtypes and devices are left as loaded.

GGUF-quantized weights (QuantizedWeight) are laid out for gemm.c's quantized kernels instead: the same panels,
holding per 32 weights along the input the 64 columns' scales (and zeros) and their codes.

Which layout a model gets is its engine's WeightLayout, handed to every layer by the loader: nothing here is
decided by module state, so two engines in one process lay out their weights independently.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm import native
from pagedllm.native.gemms import GEMM_BF16, PANELS
from pagedllm.platforms.cpu import HugePageArena

PANEL = 64  # output columns per panel; gemm.h's NR
QBLOCK = 32  # weights along the input per GGUF block: one scale (and zero) per column
Q6K_BLOCK = 16  # Q6_K's: a scale per 16
# Rows of a step from which a bfloat16 model's quantized layers multiply on AMX tiles (QuantizedWeight.linear).
BF16_MIN_ROWS = 32
BF16_PANEL = 32  # output columns per bf16 panel, and values along K per block; gemm_bf16.c's PANEL_COLS, KBLOCK


def quantized_steps_on_amx(bf16_panels: bool) -> bool:
    """Whether a model's quantized layers multiply steps of BF16_MIN_ROWS rows or more dequantized to bf16 panels,
    on AMX tiles: a model on bf16 panels where the tiles are granted and dequant_bf16_panels is built."""
    return bf16_panels and native.gemm_bf16_uses_amx() and native.dequant_bf16() is not None


class WeightLayout:
    """How one model's weights are laid out: ``bf16_panels`` rounds dense float32 weights to gemm_bf16.c's bf16
    panels (the engine's KernelChoice decides it), and panels are placed in huge pages (HugePageArena), which every
    decode step streams from memory. The loader makes one per model and hands it to each layer's
    ``process_weights_after_loading``. Layers laid out without one (``None``) get float32 panels in ordinary
    memory."""

    def __init__(self, bf16_panels: bool = False, fused_silu: bool = True):
        self.bf16_panels = bf16_panels
        self.fused_silu = fused_silu  # a gated weight's bf16 panels laid out for silu_and_mul (KernelChoice)
        self._arena = HugePageArena()
        # One buffer the model's quantized layers take turns to hold their weight in as bf16 panels (QuantizedWeight),
        # as large as the largest one's: grown only while the model loads, so that CPU graphs keep its address.
        self._bf16_scratch = torch.empty(0, dtype=torch.bfloat16)

    def quantized_steps_on_amx(self) -> bool:
        """The module's quantized_steps_on_amx for this layout's model."""
        return quantized_steps_on_amx(self.bf16_panels)

    def reserve_bf16_panels(self, out_features: int, in_features: int) -> bool:
        """Makes the bf16 scratch hold a weight of this size as gemm_bf16's panels, where the model multiplies on bf16
        panels on AMX tiles (else False)."""
        if not self.quantized_steps_on_amx():
            return False
        numel = math.prod(PANELS[GEMM_BF16.name][1](out_features, in_features))
        if numel > self._bf16_scratch.numel():
            self._bf16_scratch = torch.empty(numel, dtype=torch.bfloat16)
        return True

    def bf16_panels_scratch(self, out_features: int, in_features: int) -> torch.Tensor:
        """The scratch as gemm_bf16's panels of a weight reserve_bf16_panels made room for."""
        shape = PANELS[GEMM_BF16.name][1](out_features, in_features)
        return self._bf16_scratch[: math.prod(shape)].view(shape)

    def place(self, panels: torch.Tensor) -> torch.Tensor:
        return self._arena.copy(panels)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self._arena.zeros(shape, dtype)


def _placed(panels: torch.Tensor, layout: WeightLayout | None) -> torch.Tensor:
    return panels if layout is None else layout.place(panels)


class DenseWeight:
    """An ``[out, in]`` weight in its GEMMs' layouts; ``linear(x, bias)`` equals ``F.linear(x, weight, bias)``.
    One copy is kept: ``panels``, the native kernel's ``[ceil(out / 64), in, 64]`` float32 panels or, laid out by a
    ``layout`` with ``bf16_panels``, gemm_bf16.c's bf16 panels, where the kernel applies (``data`` None); else
    ``data``, the weight for torch (input-major in float32 on CPU).

    ``gated``: the weight is a gated MLP's ``[gate | up]`` projection; its bf16 panels are then laid out for
    ``silu_and_mul`` (gate and up interleaved, see pack_bf16_panels), which ``gated`` tells after laying out."""

    def __init__(self, weight: torch.Tensor, gated: bool = False, layout: WeightLayout | None = None):
        self.out_features, self.in_features = weight.shape
        self.panels, self.data, self.gated = None, None, False
        if (layout is not None and layout.bf16_panels and weight.dim() == 2
                and native_applies("gemm_bf16", weight.dtype, weight.device)):
            self.gated = gated and layout.fused_silu
            self.panels = pack_bf16_panels(weight, self.gated, layout)
        elif weight.dim() == 2 and native_applies("gemm", weight.dtype, weight.device):
            self.panels = pack_float32_panels(weight, layout)
        elif weight.device.type == "cpu" and weight.dtype == torch.float32:
            self.data = weight.t().contiguous().t()
        else:
            self.data = weight

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.panels is None or self.gated or x.dtype != torch.float32:
            return F.linear(x, self.unpacked().to(x.dtype), bias)  # gated panels serve silu_and_mul, not this
        kernel = native.gemm_bf16() if self.panels.dtype == torch.bfloat16 else native.gemm()
        return kernel(x, self.panels, bias, self.out_features)

    def silu_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``silu(gate) * up`` of ``F.linear(x, weight, bias)`` split in halves, in one kernel that never writes the
        projection itself (a ``gated`` weight, float32 ``x``)."""
        return native.gemm_bf16_silu_mul()(x, self.panels, bias, self.out_features, self.out_features // 2)

    def unpacked(self) -> torch.Tensor:
        """The ``[out, in]`` values (a copy when only the panels are kept)."""
        if self.data is not None:
            return self.data
        if self.panels.dtype == torch.bfloat16:
            return unpack_bf16_panels(self.panels, self.out_features, self.in_features, self.gated)
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]


def pack_float32_panels(weight: torch.Tensor, layout: WeightLayout | None = None) -> torch.Tensor:
    """``[N, K]`` -> gemm.c's panels ``[ceil(N / 64), K, 64]`` (the last zero-padded), written in one pass into
    their final memory (the layout's huge pages): no padded or transposed copy of a weight is made on the way."""
    n, k = weight.shape
    shape = (-(-n // PANEL), k, PANEL)
    panels = torch.zeros(shape, dtype=weight.dtype) if layout is None else layout.zeros(shape, weight.dtype)
    full = n // PANEL
    panels[:full].copy_(weight[: full * PANEL].unflatten(0, (full, PANEL)).transpose(1, 2))
    if n % PANEL:
        panels[full, :, : n % PANEL].copy_(weight[full * PANEL :].t())
    return panels


def pack_bf16_panels(weight: torch.Tensor, gated: bool = False, layout: WeightLayout | None = None) -> torch.Tensor:
    """``[N, K]`` float32 -> gemm_bf16's panels, ``[ceil(N / 32), ceil(K / 32), 2, 16, 16, 2]`` bf16 (rounded
    to nearest even, zero-padded): per panel of 32 columns and block of 32 along K, two tiles (columns 0-15,
    16-31) whose row i holds each column's weights at k = 2i, 2i + 1. ``gated``: the weight is ``[gate | up]``,
    and panel p holds gate's columns 16p .. 16p + 15 in its first tile, up's same columns in its second (each half
    zero-padded to whole tiles), so gemm_bf16_silu_mul finds both halves of an output column in one panel.
    Written in one pass into their final memory (the layout's huge pages, where one is given)."""
    pairs = bf16_panel_pairs(weight, gated)
    panels = torch.empty(pairs.shape, dtype=torch.int32) if layout is None else layout.zeros(pairs.shape, torch.int32)
    return as_bf16_panels(panels.copy_(pairs))


def bf16_panel_pairs(weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """pack_bf16_panels's panels as a view of the weight rounded to bf16 (padded where it needs to be), ``[panels,
    blocks, 2, 16, 16]`` int32: each word the pair of values at k = 2i, 2i + 1, which the panels keep together, so
    a copy moves them as one (a copy in 2-byte elements in this order takes markedly longer)."""
    if gated:
        weight = torch.stack([_padded_tiles(half) for half in weight.chunk(2)], dim=1).flatten(0, 2)
    n, k = weight.shape
    panels, blocks = -(-n // BF16_PANEL), -(-k // BF16_PANEL)
    rounded = weight.to(torch.bfloat16, memory_format=torch.contiguous_format)  # row-major, for the int32 view
    if (n, k) != (panels * BF16_PANEL, blocks * BF16_PANEL):
        rounded = F.pad(rounded, (0, blocks * BF16_PANEL - k, 0, panels * BF16_PANEL - n))
    return rounded.view(torch.int32).view(panels, 2, 16, blocks, 16).permute(0, 3, 1, 4, 2)


def as_bf16_panels(pairs: torch.Tensor) -> torch.Tensor:
    """Panels of bf16_panel_pairs' int32 words (contiguous, any leading dimensions) as the bf16 panels they are."""
    return pairs.view(torch.bfloat16).unflatten(-1, (-1, 2))


def _padded_tiles(half: torch.Tensor) -> torch.Tensor:
    """``[n, K]`` zero-padded to ``[ceil(n / 16), 16, K]``: one gated half's columns, a tile's worth at a time."""
    tile = BF16_PANEL // 2
    return F.pad(half, (0, 0, 0, -half.shape[0] % tile)).view(-1, tile, half.shape[1])


def unpack_bf16_panels(panels: torch.Tensor, out_features: int, in_features: int,
                       gated: bool = False) -> torch.Tensor:
    """pack_bf16_panels undone: the ``[out, in]`` bf16 values."""
    num_panels, blocks = panels.shape[:2]
    rows = panels.permute(0, 2, 4, 1, 3, 5).reshape(num_panels * BF16_PANEL, blocks * BF16_PANEL)
    if gated:  # [panel, half, 16 columns] -> [half, panel, 16 columns]
        halves = rows.view(num_panels, 2, BF16_PANEL // 2, -1).transpose(0, 1)
        return torch.cat([h.reshape(-1, h.shape[-1])[: out_features // 2, :in_features] for h in halves])
    return rows[:out_features, :in_features]


class QuantizedWeight:
    """A GGUF-quantized ``[out, in]`` weight in gemm.c's quantized panels; ``linear(x, bias)`` equals
    ``F.linear`` on the dequantized weight (float32 rows; needs the native library). In a bfloat16 model on AMX
    (``layout`` with bf16 panels; ``in_features`` given), a step of BF16_MIN_ROWS rows or more instead dequantizes
    the weight into the model's bf16 scratch as gemm_bf16's panels and multiplies on AMX tiles: F.linear on the
    dequantized weight rounded to bf16, as the model's dense layers compute, and faster than the quantized kernels'
    float32 FMAs from about that many rows (docs/benchmarks.md). In a bfloat16 model up to 4 rows of Q4_0/Q4_1,
    Q2_K-Q6_K (compact panels), Q8_0 and IQ4 take gemm.c's block sums (Gemm.for_bf16_model): float32 rounding in an
    order of its own, not the dense kernel's bits."""

    def __init__(self, kernel_name: str, panels: torch.Tensor, out_features: int,
                 layout: WeightLayout | None = None, in_features: int | None = None):
        self.kernel, self.out_features = getattr(native, kernel_name)(), out_features
        if layout is not None and layout.bf16_panels:  # a bfloat16 model: decode rows by block sums
            self.kernel = self.kernel.for_bf16_model() or self.kernel
        self.panels = _placed(panels, layout)
        self.bf16_layout = None  # the layout whose bf16 scratch the weight uses for long steps
        if layout is not None and in_features is not None and layout.reserve_bf16_panels(out_features, in_features):
            self.bf16_layout = layout

    @classmethod
    def q4(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           layout: WeightLayout | None = None) -> "QuantizedWeight":
        """4-bit codes, each weight ``code * scale + zero`` per block of 32 along K: gemm_q4_f32's panels where
        every scale is an fp16 value (Q4_0, Q4_1), else gemm_q4kc_f32's where the scales and zeros factor per
        super-block (Q4_K's d * sc and -dmin * m), else gemm_q4k_f32's, with float32 scales."""
        compact = None if _fp16_values(scales) else cls._factored(
            "gemm_q4kc", lambda: pack_q4kc_panels(codes, scales, zeros), codes.shape, layout)
        return compact or cls._nibbles(("gemm_q4", "gemm_q4k"), codes, scales, zeros, layout)

    @classmethod
    def iq4(cls, indices: torch.Tensor, scales: torch.Tensor, layout: WeightLayout | None = None
            ) -> "QuantizedWeight":
        """4-bit indices into IQ4_NL's 16 values, each weight ``value * scale`` per block of 32 along K: fp16 scales
        (IQ4_NL, gemm_iq4nl_f32) or float32 ones (IQ4_XS's d * (ls - 32), gemm_iq4xs_f32)."""
        return cls._nibbles(("gemm_iq4nl", "gemm_iq4xs"), indices, scales, None, layout)

    @classmethod
    def _nibbles(cls, kernels: tuple[str, str], codes: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, layout: WeightLayout | None) -> "QuantizedWeight":
        """Nibble panels (pack_q4_panels) for the first of ``kernels`` where every scale is an fp16 value, else,
        with float32 scales, for the second."""
        fp16 = _fp16_values(scales)
        panels = pack_q4_panels(codes, scales, zeros, torch.float16 if fp16 else torch.float32)
        return cls(kernels[0] if fp16 else kernels[1], panels, codes.shape[0], layout, codes.shape[1])

    @classmethod
    def q8(cls, codes: torch.Tensor, scales: torch.Tensor, layout: WeightLayout | None = None,
           zeros: torch.Tensor | None = None, bf16_steps: bool = True) -> "QuantizedWeight":
        """int8 codes, each weight ``code * scale (+ zero)``: per block of 32 along K with fp16 scales (Q8_0,
        gemm_q8_f32), per 16 with float32 ones (Q6_K's q - 32 and d * sc, Q3_K's q - 4 and d (sc - 32):
        gemm_q6k_f32), or with ``zeros`` per 32 or 16 with float32 scales and zeros (Q5_K's q, d * sc and
        -dmin * m: gemm_q5k_f32; Q2_K's, per 16: gemm_q2k_f32); each K-quant in its factored panels
        (gemm_q6kc_f32, gemm_q3kc_f32 for codes in [-4, 3], gemm_q5kc_f32, gemm_q2kc_f32) where its scales and zeros
        factor per super-block. Without ``bf16_steps`` (an embedding or LM head, whose bf16 copy would be the size of
        the vocabulary's weight, for logits of a few rows a step) long steps keep the quantized kernel too."""
        n, k = codes.shape[0], codes.shape[1] if bf16_steps else None
        if zeros is not None:  # per 32 (Q5_K) or 16 (Q2_K)
            block = codes.shape[1] // scales.shape[1]
            kernel = "gemm_q5k" if block == QBLOCK else "gemm_q2k"
            return (cls._factored(kernel + "c", lambda: pack_q8kc_panels(codes, scales, zeros, block), (n, k), layout)
                    or cls(kernel, pack_q8_panels(codes, scales, torch.float32, block, zeros), n, layout, k))
        if scales.shape[1] * QBLOCK == codes.shape[1]:
            return cls("gemm_q8", pack_q8_panels(codes, scales), n, layout, k)
        lowest, highest = torch.aminmax(codes)
        three_bits = bool(lowest >= -4) and bool(highest <= 3)  # Q3_K's q - 4: its own 3-bit plane
        return (cls._factored("gemm_q3kc" if three_bits else "gemm_q6kc",
                              lambda: pack_q8kc_panels(codes, scales, three_bits=three_bits), (n, k), layout)
                or cls("gemm_q6k", pack_q8_panels(codes, scales, torch.float32, Q6K_BLOCK), n, layout, k))

    @classmethod
    def _factored(cls, kernel_name: str, pack, shape: tuple[int, int | None], layout: WeightLayout | None
                  ) -> "QuantizedWeight | None":
        """A factored format's ``[out, in]`` weight (the K-quants' scales and zeros per super-block:
        pack_q4kc_panels, pack_q8kc_panels), where ``kernel_name``'s kernel is built here and ``pack()`` gives panels;
        else None, and the caller keeps the float32 layout. ``in`` None: no bf16 steps (QuantizedWeight)."""
        panels = pack() if getattr(native, kernel_name)() is not None else None
        return None if panels is None else cls(kernel_name, panels, shape[0], layout, shape[1])

    @classmethod
    def w8a8(cls, panels: torch.Tensor, out_features: int, layout: WeightLayout | None = None) -> "QuantizedWeight":
        """int8 per-channel weights in gemm_int8.c's panels (layers/quantization/int8.pack_w8a8_panels); rows are
        quantized per token by the kernel as it reads them, so ``linear`` is the W8A8 product, not F.linear's."""
        return cls("gemm_w8a8", panels, out_features, layout)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """``x @ W.T (+ bias)``; into ``out`` (rows of float32 ``[rows, out_features]``, which may be the columns of a
        wider tensor) where given."""
        in_features = x.shape[-1]
        if self.bf16_layout is not None and x.numel() >= BF16_MIN_ROWS * in_features:
            panels = self.bf16_layout.bf16_panels_scratch(self.out_features, in_features)
            native.dequant_bf16()(self.panels, panels, self.out_features, in_features, self.kernel)
            return native.gemm_bf16()(x, panels, bias, self.out_features, out=out)
        return self.kernel(x, self.panels, bias, self.out_features, out=out)


def pack_q4_panels(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``[N, K]`` codes in [0, 16) and ``[N, K / 32]`` scales and zeros -> gemm_q4_f32's panels,
    ``[ceil(N / 64), K / 32, 1408]`` bytes (with float32 ``scale_dtype``: gemm_q4k_f32's, 1536): per block of 32
    along K, the 64 columns' scales (fp16, which Q4_0/Q4_1 scales are exactly), zeros (float32), then 32 rows of 32
    bytes, column i in the low nibble of byte i and column 32 + i in its high nibble. Without ``zeros`` (IQ4's
    records: the codes index a table) the zeros are left out."""
    by_row, to_block = _panel_blocks(codes, scales, scale_dtype)
    nibbles = (by_row[..., : PANEL // 2] | (by_row[..., PANEL // 2 :] << 4)).contiguous()
    params = [to_block(scales, scale_dtype)] + ([] if zeros is None else [to_block(zeros, torch.float32)])
    return torch.cat([*params, to_block(nibbles)], dim=-1)


SUPER_K = 256  # weights along K per super-block of the factored panels (gemm_quant.h's SUPER_K)


def factor_blocks(values: torch.Tensor, per_super: int, signed: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``[N, B]`` float32 per-block values, B a multiple of ``per_super`` -> per super-block factors
    ``[N, B / per_super]`` (float32) and per-block multipliers ``[N, B]`` (uint8, or ``signed`` int8) with
    factor * multiplier == value exactly in float32; None where some super-block has none (unsigned: values of both
    signs; multipliers past the type's range). A Q4_K super-block's d * sc (and -dmin * m), a Q6_K one's d * sc,
    always factor so: the factor is the greatest common divisor of the super-block's values, each as an integer
    significand at the super-block's smallest exponent."""
    n, blocks = values.shape
    v = values.reshape(n, blocks // per_super, per_super).numpy().astype(np.float32)
    if signed:
        sign = np.where(v < 0, np.float32(-1), np.float32(1))
    else:
        sign = np.where((v < 0).any(-1), np.float32(-1), np.float32(1))[..., None]
    if ((v * sign) < 0).any() or not np.isfinite(v).all():
        return None
    significand, exponent = np.frexp(np.abs(v))
    integers = (significand.astype(np.float64) * 2.0 ** 24).astype(np.int64)  # exact: 24-bit significands
    exponent = exponent.astype(np.int64) - 24
    lowest = np.where(integers > 0, exponent, np.iinfo(np.int64).max).min(-1, keepdims=True)
    shift = np.where(integers > 0, exponent - lowest, 0)
    if (shift > 30).any():
        return None
    aligned = integers << shift
    gcd = np.gcd.reduce(aligned, axis=-1, keepdims=True)
    factors = np.where(gcd > 0, np.ldexp(gcd.astype(np.float64), np.where(gcd > 0, lowest, 0)), 0.0)
    if signed:
        multipliers = (aligned // np.maximum(gcd, 1)) * sign.astype(np.int64)
        factors, low, high, dtype = factors.astype(np.float32), -128, 127, np.int8
    else:
        multipliers = aligned // np.maximum(gcd, 1)
        factors, low, high, dtype = (factors * sign).astype(np.float32), 0, 255, np.uint8
    if (multipliers < low).any() or (multipliers > high).any() or not np.array_equal(
            factors * multipliers.astype(np.float32), v):
        return None
    return (torch.from_numpy(factors.reshape(n, -1).copy()),
            torch.from_numpy(multipliers.astype(dtype).reshape(n, blocks)))


def pack_q4kc_panels(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor | None:
    """``[N, K]`` codes in [0, 16) and ``[N, K / 32]`` float32 scales and zeros (Q4_K's d * sc and -dmin * m) ->
    gemm_q4kc_f32's panels, ``[ceil(N / 64), K / 256 * 512 + K / 32 * 1152]`` bytes: a header of each super-block's
    64 scale factors then 64 zero factors (float32), then per block of 32 the 64 columns' scale multipliers, zero
    multipliers (uint8) and pack_q4_panels' 32 rows of nibbles. None where K is no multiple of 256 or the scales or
    zeros do not factor (factor_blocks): such weights keep pack_q4_panels' float32 layout."""
    if codes.shape[1] % SUPER_K:
        return None
    per_super = SUPER_K // QBLOCK
    scale_parts, zero_parts = factor_blocks(scales.float(), per_super), factor_blocks(zeros.float(), per_super)
    if scale_parts is None or zero_parts is None:
        return None
    by_row, to_block = _panel_blocks(codes, scales, torch.float32)
    nibbles = to_block((by_row[..., : PANEL // 2] | (by_row[..., PANEL // 2 :] << 4)).contiguous())
    records = torch.cat([to_block(scale_parts[1]), to_block(zero_parts[1]), nibbles], dim=-1)
    return _with_header(records, codes.shape[0], [scale_parts[0], zero_parts[0]])


def pack_q8kc_panels(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                     block: int = Q6K_BLOCK, three_bits: bool = False) -> torch.Tensor | None:
    """``[N, K]`` int8 codes and ``[N, K / block]`` float32 scales (and zeros) -> the factored bit-packed panels:
    without zeros gemm_q6kc_f32's (Q6_K's q - 32 and d * sc, per 16, int8 multipliers), or with ``three_bits``
    gemm_q3kc_f32's (Q3_K's q - 4 and d * (sc - 32): a 3-bit plane alone), with them per 32 gemm_q5kc_f32's and
    per 16 gemm_q2kc_f32's (Q5_K's and Q2_K's q, d * sc and -dmin * m, uint8 multipliers; Q2_K's 4-bit ones sharing
    a byte, the scale's low); ``[ceil(N / 64), K / 256 * header + K / block * record]`` bytes: a header of each
    super-block's 64 scale factors (then zero factors; float32), then per block the 64 columns' scale (then zero)
    multipliers and the codes bit-packed (pack_code_rows). None where K is no multiple of 256, the values do not
    factor, a code does not fit its bits or a Q2_K multiplier its nibble: such weights keep pack_q8_panels' float32
    layout."""
    if codes.shape[1] % SUPER_K:
        return None
    signed, per_super = zeros is None, SUPER_K // block
    parts = [factor_blocks(values.float(), per_super, signed) for values in ([scales] if signed else [scales, zeros])]
    if any(part is None for part in parts):
        return None
    by_row, to_block = _panel_blocks(codes, scales, torch.float32, block)
    bits, offset = (3, 4) if three_bits else (6, 32) if signed else (5, 0) if block == QBLOCK else (2, 0)
    rows = pack_code_rows(by_row, bits, offset)
    if rows is None:
        return None
    multipliers = [part[1] for part in parts]
    if bits == 2:  # Q2_K's: its 4-bit scale and zero multipliers share a byte (gemm_quant.h's nibble_multipliers)
        if any(bool((m >= 16).any()) for m in multipliers):
            return None
        multipliers = [multipliers[0] | (multipliers[1] << 4)]
    records = torch.cat([*(to_block(m) for m in multipliers), to_block(rows)], dim=-1)
    return _with_header(records, codes.shape[0], [part[0] for part in parts])


def pack_code_rows(by_row: torch.Tensor, bits: int, offset: int) -> torch.Tensor | None:
    """``[..., rows, 64]`` integer codes -> their bit-packed rows as gemm_quant.h's packed formats hold them, ``[...,
    rows * bytes]`` uint8: the codes made unsigned (plus ``offset``), for 4 to 6 ``bits`` their low 4 bits in
    rows of nibbles (column i in the low nibble of byte i, 32 + i in its high one), then the bits above them (or
    all of 2- and 3-bit codes) in rows of 8 * plane_bits bytes, column c at bit c * plane_bits (little-endian);
    all the nibble rows first, then all the plane rows. None where a code does not fit in ``bits`` bits."""
    values = by_row.to(torch.int32) + offset
    if bool((values < 0).any()) or bool((values >= 1 << bits).any()):
        return None
    planes = []
    if bits >= 4:
        low = values & 15
        planes.append((low[..., : PANEL // 2] | (low[..., PANEL // 2 :] << 4)).to(torch.uint8))
        values, bits = values >> 4, bits - 4
    if bits == 0:
        return planes[0].flatten(-2)
    # each code's bits, lowest first, in column order: the plane's bits in order, 8 to a byte
    plane_bits = (values[..., None] >> torch.arange(bits, dtype=torch.int32)) & 1
    by_byte = plane_bits.reshape(*values.shape[:-1], PANEL * bits // 8, 8)
    planes.append((by_byte << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8))
    return torch.cat([plane.flatten(-2) for plane in planes], dim=-1)


def _with_header(records: torch.Tensor, n: int, factors: list[torch.Tensor]) -> torch.Tensor:
    """A factored format's panels: per panel a header of each super-block's factors (``factors``' tensors
    ``[N, super-blocks]`` float32, 64 columns of each in turn), then its ``records`` ``[panel, block, bytes]``."""
    panels = records.shape[0]

    def per_super_block(values: torch.Tensor) -> torch.Tensor:  # [N, S] -> [panel, S, 64]
        padded = torch.zeros(panels * PANEL, values.shape[1], dtype=torch.float32)
        padded[:n] = values
        return padded.view(panels, PANEL, -1).permute(0, 2, 1)

    header = torch.cat([per_super_block(f) for f in factors], dim=-1)
    return torch.cat([header.contiguous().view(torch.uint8).reshape(panels, -1), records.reshape(panels, -1)], dim=-1)


def pack_q8_panels(codes: torch.Tensor, scales: torch.Tensor, scale_dtype: torch.dtype = torch.float16,
                   block: int = QBLOCK, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, K]`` int8 codes and ``[N, K / 32]`` scales -> gemm_q8_f32's panels, ``[ceil(N / 64), K / 32, 2176]``
    bytes: per block of 32 along K, the 64 columns' fp16 scales, then 32 rows of their 64 codes. With float32
    ``scale_dtype`` and ``block`` 16 (scales ``[N, K / 16]``): gemm_q6k_f32's, ``[ceil(N / 64), K / 16, 1280]``;
    with float32 scales and ``zeros`` (after the scales, float32) per 32: gemm_q5k_f32's, ``[.., K / 32, 2560]``."""
    by_row, to_block = _panel_blocks(codes, scales, scale_dtype, block)
    params = [to_block(scales, scale_dtype)] + ([] if zeros is None else [to_block(zeros, torch.float32)])
    return torch.cat([*params, to_block(by_row.contiguous())], dim=-1)


def _fp16_values(scales: torch.Tensor) -> bool:
    return torch.equal(scales.to(torch.float16).float(), scales.float())


def _panel_blocks(codes: torch.Tensor, scales: torch.Tensor, scale_dtype: torch.dtype, block: int = QBLOCK):
    """The codes as ``[panel, block, row, column]`` (N padded to whole 64-column panels), and a function laying
    a per-block ``[N, K / block]`` tensor (or those codes) out as ``[panel, block, bytes]``. ``scales`` must be
    ``scale_dtype`` values (the panels hold them so)."""
    n, k = codes.shape
    panels, blocks = -(-n // PANEL), k // block
    if scale_dtype == torch.float16 and not _fp16_values(scales):
        raise ValueError("GGUF scales must be float16 values (GGUF stores them so)")

    def padded(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(panels * PANEL, *t.shape[1:], dtype=t.dtype)
        out[:n] = t
        return out

    by_row = padded(codes).view(panels, PANEL, blocks, block).permute(0, 2, 3, 1)

    def to_block(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        if t.dim() == 2:  # per block and column
            t = padded(t.to(dtype)).view(panels, PANEL, blocks).permute(0, 2, 1).contiguous()
        return t.view(torch.uint8).reshape(panels, blocks, -1)

    return by_row, to_block


def native_applies(kernel_name: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``kernel_name`` (gemm.c's gemm, gemm_q4, gemm_q8, or gemm_bf16.c's gemm_bf16) serves a layer of this
    dtype on this device: float32 on CPU, with the native library built."""
    return dtype == torch.float32 and device.type == "cpu" and getattr(native, kernel_name)() is not None
