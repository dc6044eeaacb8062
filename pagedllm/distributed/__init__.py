"""Distributed execution: process groups over torch.distributed, the collectives layers call, and the
shared-memory queue that broadcasts each step to the workers."""
from pagedllm.distributed.communication_op import (tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce,
                                                   tensor_model_parallel_gather)
from pagedllm.distributed.parallel_state import ParallelRank, get_pp_group, get_tp_group

__all__ = ["ParallelRank", "get_pp_group", "get_tp_group", "tensor_model_parallel_all_gather",
           "tensor_model_parallel_all_reduce", "tensor_model_parallel_gather"]
