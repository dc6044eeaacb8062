"""Process groups of one engine's ranks over torch.distributed: world, tensor-parallel (TP) and pipeline-parallel
(PP), as vLLM's parallel_state lays them out.

Global rank = pp_rank * tp_size + tp_rank: TP group p holds ranks [p * tp, (p + 1) * tp), PP group t holds
t, t + tp, t + 2 tp, ... One worker process is one rank, so the groups are this process's (module state, as in
vLLM: torch.distributed's own state is per process). A process that never calls init_distributed_environment
(the in-process uni executor) has no groups, and every collective below is then the identity of one rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelRank:
    """Where one worker sits in its engine: the slice of the model it holds."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # Mixture-of-experts layers split their experts over the TP ranks (each holds whole experts) rather than every
    # expert's intermediate dimension (vLLM's enable_expert_parallel).
    expert_parallel: bool = False

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The rank whose ModelRunnerOutput goes back to the engine: TP rank 0 of the last stage."""
        return self.tp_rank == 0 and self.is_last_pp_rank

    @classmethod
    def of(cls, rank: int, tp_size: int, pp_size: int, expert_parallel: bool = False) -> "ParallelRank":
        return cls(rank % tp_size, tp_size, rank // tp_size, pp_size, expert_parallel)


class GroupCoordinator:
    """One process group and this process's place in it; collectives on CPU tensors (gloo)."""

    def __init__(self, ranks: list[int], group: Optional[dist.ProcessGroup]) -> None:
        self.ranks = ranks
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(dist.get_rank()) if group is not None else 0
        self.device_group = group

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (the next pipeline stage)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group (in place; callers pass a tensor they own)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every member's ``x`` concatenated along ``dim`` in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> Optional[torch.Tensor]:
        """The members' ``x`` concatenated along ``dim`` on member ``dst``; None elsewhere."""
        if self.world_size == 1:
            return x
        is_dst = self.rank_in_group == dst
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if is_dst else None
        dist.gather(x.contiguous(), parts, dst=self.ranks[dst], group=self.device_group)
        return torch.cat(parts, dim=dim) if is_dst else None

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Member ``src``'s ``x`` into every member's ``x`` (same shape and dtype everywhere)."""
        if self.world_size > 1:
            dist.broadcast(x, src=self.ranks[src], group=self.device_group)
        return x

    def send_tensors(self, tensors: list[torch.Tensor], dst: int) -> None:
        """Point-to-point to global rank ``dst``, which receives them with recv_tensors in the same order."""
        for t in tensors:
            dist.send(t.contiguous(), dst=dst, group=self.device_group)

    def recv_tensors(self, buffers: list[torch.Tensor], src: int) -> list[torch.Tensor]:
        """Fill ``buffers`` (shapes known to both sides) from global rank ``src``."""
        for b in buffers:
            dist.recv(b, src=src, group=self.device_group)
        return buffers


_SINGLE = GroupCoordinator([0], None)
_TP: GroupCoordinator = _SINGLE
_PP: GroupCoordinator = _SINGLE


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def init_distributed_environment(world_size: int, rank: int, init_method: str, backend: str = "gloo",
                                 timeout_s: float = 600.0) -> None:
    """Join the engine's world group (every rank calls it with the same ``init_method``)."""
    import datetime
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))


def initialize_model_parallel(tp_size: int, pp_size: int) -> None:
    """Make the TP and PP groups. Every rank creates every group in the same order (torch.distributed's rule),
    and keeps the ones it belongs to."""
    global _TP, _PP
    world = dist.get_world_size()
    if world != tp_size * pp_size:
        raise ValueError(f"world size {world} != tensor_parallel_size {tp_size} x pipeline_parallel_size {pp_size}")
    rank = dist.get_rank()
    backend = dist.get_backend()
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            _TP = GroupCoordinator(ranks, group)
    for tp_rank in range(tp_size):
        ranks = list(range(tp_rank, world, tp_size))
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            _PP = GroupCoordinator(ranks, group)


def destroy_model_parallel() -> None:
    global _TP, _PP
    _TP = _PP = _SINGLE
    if dist.is_initialized():
        dist.destroy_process_group()
