"""The single place tensor-parallel layers talk across ranks.

With one rank these are identities. A distributed backend replaces the bodies
(e.g. ``torch.distributed.all_reduce`` over the TP group) without touching the
layers or models that call them.
"""

import torch


def tensor_model_parallel_all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum ``x`` over the TP group."""
    if tp_size == 1:
        return x
    raise NotImplementedError("tensor-parallel all-reduce needs a distributed backend")


def tensor_model_parallel_all_gather(x: torch.Tensor, tp_size: int, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    if tp_size == 1:
        return x
    raise NotImplementedError("tensor-parallel all-gather needs a distributed backend")
