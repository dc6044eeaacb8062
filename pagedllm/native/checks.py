"""Checks of a kernel call's tensors before the call, on with ``PAGEDLLM_NATIVE_CHECKS=1`` (the tests turn it on).

A C kernel takes raw pointers and sizes: a wrong dtype, shape or stride does not fail, it reads or writes the wrong
memory. So every typed wrapper (native/attention.py, native/fused.py, native/gemms.py) can check, before it calls,
that each tensor is what the C side assumes, and raise NativeCallError naming the kernel and the argument. Off by
default: the checks cost a few torch ops per call, and a decode step makes hundreds of calls.
"""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("PAGEDLLM_NATIVE_CHECKS", "0") == "1"


class NativeCallError(ValueError):
    """A kernel was about to be called with tensors it does not take."""


def expect(kernel: str, name: str, t: torch.Tensor, dtype: torch.dtype | tuple[torch.dtype, ...],
           shape: tuple | None = None, contiguous: bool = False, dense_rows: bool = False) -> None:
    """``t`` is a CPU tensor of ``dtype`` (or one of them) and ``shape`` (None entries match any size); with
    ``contiguous`` it is contiguous, with ``dense_rows`` everything but its first dimension is (rows may be
    strided, as in a view of the fused QKV output)."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    problems = []
    if not isinstance(t, torch.Tensor):
        raise NativeCallError(f"{kernel}: {name} must be a tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        problems.append(f"is on {t.device}")
    if t.dtype not in dtypes:
        problems.append(f"is {t.dtype}, not {' or '.join(str(d) for d in dtypes)}")
    if shape is not None and (t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape))):
        problems.append(f"has shape {tuple(t.shape)}, not {tuple('*' if s is None else s for s in shape)}")
    if contiguous and not t.is_contiguous():
        problems.append(f"is not contiguous (strides {t.stride()})")
    if dense_rows and t.dim() > 1 and t.shape[0] > 0 and not t[0].is_contiguous():
        problems.append(f"has rows that are not contiguous (strides {t.stride()})")
    if problems:
        raise NativeCallError(f"{kernel}: {name} {'; '.join(problems)}")


def require(kernel: str, condition: bool, message: str) -> None:
    """A relation between arguments the kernel relies on."""
    if not condition:
        raise NativeCallError(f"{kernel}: {message}")


def check_block_tables(kernel: str, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                       num_slots: int) -> None:
    """Every block a request reads (its first ceil(seq_len / block_size) entries) lies inside the cache."""
    used = torch.arange(block_table.shape[1])[None, :] < (seq_lens.long()[:, None] + block_size - 1) // block_size
    longest = int(seq_lens.max()) if seq_lens.numel() else 0
    require(kernel, block_table.shape[0] == seq_lens.shape[0], "the block table and seq_lens differ in rows")
    require(kernel, longest <= block_table.shape[1] * block_size,
            f"a sequence is longer than its block table ({block_table.shape[1]} blocks of {block_size})")
    blocks = block_table.long()[used]
    require(kernel, bool(((blocks >= 0) & (blocks < num_slots // block_size)).all()),
            f"a block table entry in use is outside the cache's {num_slots // block_size} blocks")
