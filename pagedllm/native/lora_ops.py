"""Typed call of lora.c: multi-LoRA's shrink and expand for one linear layer's rows of every adapter slot, declared once
(LORA_SIGNATURES) and called through ``lora_add``, for float32 or bf16 slots. It returns False where the kernel does
not apply (no library, rows that are not float32 on CPU with contiguous rows, slots of another dtype), and the caller
(lora/layers.py) runs its torch path, which stays the reference."""

import torch

from pagedllm import native
from pagedllm.native import checks
from pagedllm.native.checks import expect, require
from pagedllm.native.graph import launch
from pagedllm.native.signature import INT, INT64, POINTER, CFunction, arguments

_LORA_ADD_ARGS = arguments("x", POINTER, "ldx", INT64, "y", POINTER, "ldy", "rows", INT64, "token_slots", "holds",
                           POINTER, "max_loras", INT, "lora_a", POINTER, "lda", INT, "lora_b", POINTER, "in_features",
                           "rank", "slices", INT, "slice_offsets", POINTER)
LORA_SIGNATURES = (
    CFunction("lora_add_f32", INT, *_LORA_ADD_ARGS),
    CFunction("lora_add_bf16", INT, *_LORA_ADD_ARGS),
)
_KERNELS = {torch.float32: "lora_add_f32", torch.bfloat16: "lora_add_bf16"}  # by the slots' dtype
LANES = 16  # lora.c's: lora_a's rows hold a whole number of chunks of this many lanes (its shrink reads them whole)


def lanes(width: int) -> int:
    """``width`` rank columns of lora_a rounded up to whole chunks of LANES."""
    return -(-width // LANES) * LANES


def lora_add(y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, holds: torch.Tensor,
             lora_a: torch.Tensor, lora_b: torch.Tensor, slice_offsets: torch.Tensor) -> bool:
    """``y[r] += (x[r] lora_a[s]) lora_b[s]`` for each row r whose slot s = token_slots[r] is >= 0 and holds[s],
    slice by slice (lora/layers.LinearLoRA describes the layout); False when the native path does not apply."""
    lib, name = native.lora(), _KERNELS.get(lora_a.dtype)
    if (lib is None or name is None or x.dtype != torch.float32 or y.dtype != torch.float32 or x.device.type != "cpu"
            or x.dim() != 2 or y.dim() != 2 or x.stride(1) != 1 or y.stride(1) != 1):
        return False
    max_loras, in_features, lda = lora_a.shape
    rank, slices = lora_b.shape[1], slice_offsets.numel() - 1
    if checks.ENABLED:
        expect(name, "token_slots", token_slots, torch.int64, (x.shape[0],), contiguous=True)
        expect(name, "holds", holds, torch.uint8, (max_loras,), contiguous=True)
        expect(name, "lora_a", lora_a, lora_a.dtype, (None, x.shape[1], None), contiguous=True)
        expect(name, "lora_b", lora_b, lora_a.dtype, (max_loras, None, y.shape[1]), contiguous=True)
        expect(name, "slice_offsets", slice_offsets, torch.int64, (slices + 1,), contiguous=True)
        require(name, y.shape[0] == x.shape[0], f"y {tuple(y.shape)} and x {tuple(x.shape)} differ in rows")
        require(name, int(slice_offsets[-1]) == y.shape[1] and lda >= slices * rank and lda % LANES == 0,
                f"{slices} slices of rank {rank} must fit lora_a's {lda} lanes (a multiple of {LANES}) and end at "
                f"y's {y.shape[1]} columns")
    status = launch(getattr(lib, name), x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[0],
                    token_slots.data_ptr(), holds.data_ptr(), max_loras, lora_a.data_ptr(), lda, lora_b.data_ptr(),
                    in_features, rank, slices, slice_offsets.data_ptr())
    if status == -2:
        raise MemoryError(f"{name}: no memory for the scratch of {x.shape[0]} rows")
    if status != 0:
        raise IndexError(f"{name}: a token's adapter slot is not below max_loras ({max_loras})")
    return True
