"""The collectives tensor-parallel layers call, over this process's TP group (identities with one rank)."""
from __future__ import annotations

from typing import Optional

import torch

from pagedllm.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """Sum ``input_`` over the TP group."""
    return get_tp_group().all_reduce(input_)


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's ``input_`` along ``dim``, in rank order."""
    return get_tp_group().all_gather(input_, dim)


def tensor_model_parallel_gather(input_: torch.Tensor, dst: int = 0, dim: int = -1) -> Optional[torch.Tensor]:
    """Concatenate along ``dim`` on TP rank ``dst`` only (None on the others)."""
    return get_tp_group().gather(input_, dst, dim)
