"""Decode steps replayed from CPU graphs (native/graph.py): per step shape, static input buffers and the graphs
captured over them, as vLLM's model runner keeps CUDA graphs per batch size. A step's shape is its number of
requests and of tokens: a plain decode step has one token per request, a verify step of speculative decoding a
request's drafts after its token (their query rows then all go to the native prefill kernel, which reads each
request's query start and length from static buffers when it runs, so one graph serves any split of the tokens).
A graph is also keyed by how long a prefix all its requests share, when attention takes that prefix once for all
rows (cascade attention): the kernels' arguments differ with it; and by whether adapters run (multi-LoRA), since
the LoRA'd layers launch their kernel only in steps with adapters. Which adapter each token takes is an input, read
from a static buffer like the token ids, so one graph serves any mix of adapters.

Steps of up to MAX_GRAPH_BATCH requests and MAX_GRAPH_TOKENS tokens use graphs. The graphs share one pool for
their activations (~1.1 MB a token for SmolLM2-135M, so ~70 MB at 64), which also spares replays the allocations
an eager step makes. A replay drops the Python around the kernels, which costs about as much as the kernels at one
row and still a visible share of a 64-row step, so graphs pay at every batch size up to the cap. Larger steps run
eagerly, and so does any key whose capture was refused (e.g. cascade attention on torch's SDPA where the native
prefix kernel does not apply, or a verify step where the native prefill tiles do not).
"""

import logging

import numpy as np
import torch

from pagedllm.layers.attention.cpu_plan import shared_prefix_tokens
from pagedllm.layers.attention.metadata import AttentionMetadata
from pagedllm.lora.punica import PunicaWrapper
from pagedllm.native.graph import CpuGraph, GraphPool

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 64
MAX_GRAPH_TOKENS = 128


def cpu_graphs_apply(model_config, model, world_size: int = 1) -> bool:
    """Whether decode steps of ``model`` (of ``model_config``) replay CPU graphs. A graph replays kernels, not
    collectives: more than one rank runs every step eagerly; so does a model whose step computes with torch ops
    between the kernels (a capture would be refused at every shape), one off the CPU, and one whose attention is not
    the CPU backend's (its kernels are what a graph replays)."""
    return (not model_config.enforce_eager and world_size == 1 and model.supports_cpu_graphs
            and model_config.device == "cpu" and model_config.attention_backend == "TORCH_SDPA")


class _StaticInputs:
    """The tensors the graphs of steps of ``num_reqs`` requests and ``num_tokens`` tokens read their step's inputs
    from, in the same memory every step. The block table holds every request's full width, so a history growing by
    a block changes no shape."""

    def __init__(self, num_reqs: int, num_tokens: int, block_table_width: int):
        self.input_ids = torch.zeros(num_tokens, dtype=torch.int64)
        self.positions = torch.zeros(num_tokens, dtype=torch.int64)
        self.slot_mapping = torch.zeros(num_tokens, dtype=torch.int64)
        self.token_slots = torch.full((num_tokens,), -1, dtype=torch.int64)  # each token's adapter slot (LoRA)
        self.seq_lens = torch.zeros(num_reqs, dtype=torch.int32)
        self.block_table = torch.zeros(num_reqs, block_table_width, dtype=torch.int32)
        self.query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int64)
        # A verify step's chunks, as the native prefill kernel reads them; a decode step's rows are one apiece.
        self.chunk_query_start = self.chunk_query_len = None
        if num_tokens > num_reqs:
            self.chunk_query_start = torch.zeros(num_reqs, dtype=torch.int32)
            self.chunk_query_len = torch.zeros(num_reqs, dtype=torch.int32)
        self.graphs: dict[tuple[int, bool], CpuGraph] = {}  # by shared prefix tokens and whether adapters run

    def fill(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, seq_lens: np.ndarray,
             block_table: np.ndarray, query_start_loc: np.ndarray) -> None:
        self.input_ids.numpy()[:] = input_ids
        self.positions.numpy()[:] = positions
        self.slot_mapping.numpy()[:] = slot_mapping
        self.seq_lens.numpy()[:] = seq_lens
        self.block_table.numpy()[:] = block_table
        if self.chunk_query_len is not None:
            self.query_start_loc.numpy()[:] = query_start_loc
            self.chunk_query_start.numpy()[:] = query_start_loc[:-1]
            self.chunk_query_len.numpy()[:] = np.diff(query_start_loc)

    def metadata(self) -> AttentionMetadata:
        max_query_len = 1 if self.chunk_query_len is None else int(self.chunk_query_len.max())
        return AttentionMetadata(num_actual_tokens=self.input_ids.shape[0], slot_mapping=self.slot_mapping,
                                 query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                                 block_table=self.block_table, max_query_len=max_query_len,
                                 max_seq_len=int(self.seq_lens.max()), chunk_query_start=self.chunk_query_start,
                                 chunk_query_len=self.chunk_query_len)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, block_size: int, block_table_width: int):
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.block_table_width = block_size, block_table_width
        self._by_shape: dict[tuple[int, int], _StaticInputs] = {}  # by (requests, tokens)
        self._pool = GraphPool()
        self._refused: set[tuple[int, int, int, bool]] = set()  # (requests, tokens, shared prefix, adapters run)
        self.captured = False  # whether the last forward captured a graph (its time is no step's)

    def forward(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                seq_lens: np.ndarray, block_table: np.ndarray, query_start_loc: np.ndarray,
                punica: PunicaWrapper | None = None) -> torch.Tensor | None:
        """Final hidden states ``[tokens, hidden]`` of a decode or verify step (each request's query: its last
        token, then its drafts, if any), from the graph of its key, captured now if this is its first step; None
        where no graph serves the step (too many requests or tokens, or its capture was refused). The result is in
        the graphs' shared pool: the next graph step overwrites it. With adapters in the step (``punica``
        active), its tokens' slots move into the static buffer the LoRA kernels read, and the graph is one
        captured with them."""
        num_reqs, num_tokens = len(seq_lens), len(input_ids)
        self.captured = False
        if num_reqs > MAX_GRAPH_BATCH or num_tokens > MAX_GRAPH_TOKENS:
            return None
        static = self._by_shape.get((num_reqs, num_tokens))
        if static is None:
            static = self._by_shape[num_reqs, num_tokens] = _StaticInputs(num_reqs, num_tokens,
                                                                         self.block_table_width)
        static.fill(input_ids, positions, slot_mapping, seq_lens, block_table, query_start_loc)
        metadata = static.metadata()
        lora = punica is not None and punica.active
        if lora:
            static.token_slots.copy_(punica.token_slots)
            punica.update(static.token_slots)
        prefix = shared_prefix_tokens(metadata, self.block_size) if num_reqs > 1 else 0
        key = (num_reqs, num_tokens, prefix, lora)
        if key in self._refused:
            return None
        graph = static.graphs.get(key[2:])
        if graph is not None:
            return graph.replay()
        graph = CpuGraph(self._pool)
        self.captured = True
        hidden_states = graph.capture(lambda: self.model(static.input_ids, static.positions, self.kv_caches,
                                                         metadata))
        if graph.failure is None:
            static.graphs[key[2:]] = graph
        else:
            logger.info("Steps of %d requests and %d tokens (shared prefix %d tokens, adapters %s) run eagerly: "
                        "their CPU graph was refused (%s)", *key, graph.failure)
            self._refused.add(key)
        return hidden_states
