"""Decode steps replayed from CPU graphs (native/graph.py): per decode batch size, static input buffers and the
graphs captured over them, as vLLM's model runner keeps CUDA graphs per batch size. A graph is keyed by the
batch size, by how long a prefix all its requests share, when attention takes that prefix once for all rows
(cascade attention): the kernels' arguments differ with it; and by whether adapters run (multi-LoRA), since the
LoRA'd layers launch their kernel only in steps with adapters. Which adapter each row takes is an input, read from a
static buffer like the token ids, so one graph serves any mix of adapters.

Batches of up to MAX_GRAPH_BATCH rows use graphs. The graphs share one pool for their activations (~1.1 MB a row
for SmolLM2-135M, so ~70 MB at 64 rows), which also spares replays the allocations an eager step makes. A replay
drops the Python around the kernels, which costs about as much as the kernels at one row and still a visible share
of a 64-row step, so graphs pay at every batch size up to the cap. Batches above the cap run eagerly, and so does
any key whose capture was refused (e.g. cascade attention on torch's SDPA where the native prefix kernel does not
apply).
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


class _StaticInputs:
    """The tensors the graphs of ``n`` decode rows read their step's inputs from, in the same memory every step.
    The block table holds every request's full width, so a history growing by a block changes no shape."""

    def __init__(self, n: int, block_table_width: int):
        self.input_ids = torch.zeros(n, dtype=torch.int64)
        self.positions = torch.zeros(n, dtype=torch.int64)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64)
        self.seq_lens = torch.zeros(n, dtype=torch.int32)
        self.block_table = torch.zeros(n, block_table_width, dtype=torch.int32)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int64)
        self.token_slots = torch.full((n,), -1, dtype=torch.int64)  # each row's adapter slot (multi-LoRA)
        self.graphs: dict[tuple[int, bool], CpuGraph] = {}  # by shared prefix tokens and whether adapters run

    def fill(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, seq_lens: np.ndarray,
             block_table: np.ndarray) -> None:
        self.input_ids.numpy()[:] = input_ids
        self.positions.numpy()[:] = positions
        self.slot_mapping.numpy()[:] = slot_mapping
        self.seq_lens.numpy()[:] = seq_lens
        self.block_table.numpy()[:] = block_table

    def metadata(self) -> AttentionMetadata:
        n = self.seq_lens.shape[0]
        return AttentionMetadata(num_actual_tokens=n, slot_mapping=self.slot_mapping,
                                 query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                                 block_table=self.block_table, max_query_len=1,
                                 max_seq_len=int(self.seq_lens.max()))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, block_size: int, block_table_width: int):
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.block_table_width = block_size, block_table_width
        self._by_size: dict[int, _StaticInputs] = {}
        self._pool = GraphPool()
        self._refused: set[tuple[int, int, bool]] = set()  # (rows, shared prefix tokens, adapters run)

    def forward(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                seq_lens: np.ndarray, block_table: np.ndarray, punica: PunicaWrapper | None = None
                ) -> torch.Tensor | None:
        """Final hidden states ``[n, hidden]`` of a batch of ``n`` decode rows (one token per request), from the
        graph of its key, captured now if this is its first step; None where no graph serves the batch (too
        many rows, or its capture was refused). The result is in the graphs' shared pool: the next graph step
        overwrites it. With adapters in the step (``punica`` active), its rows' slots move into the static
        buffer the LoRA kernels read, and the graph is one captured with them."""
        n = len(input_ids)
        if n > MAX_GRAPH_BATCH:
            return None
        static = self._by_size.get(n)
        if static is None:
            static = self._by_size[n] = _StaticInputs(n, self.block_table_width)
        static.fill(input_ids, positions, slot_mapping, seq_lens, block_table)
        metadata = static.metadata()
        lora = punica is not None and punica.active
        if lora:
            static.token_slots.copy_(punica.token_slots)
            punica.update(static.token_slots)
        key = (n, shared_prefix_tokens(metadata, self.block_size) if n > 1 else 0, lora)
        if key in self._refused:
            return None
        graph = static.graphs.get(key[1:])
        if graph is not None:
            return graph.replay()
        graph = CpuGraph(self._pool)
        hidden_states = graph.capture(lambda: self.model(static.input_ids, static.positions, self.kv_caches,
                                                         metadata))
        if graph.failure is None:
            static.graphs[key[1:]] = graph
        else:
            logger.info("Decode steps of %d rows (shared prefix %d tokens, adapters %s) run eagerly: their CPU "
                        "graph was refused (%s)", *key, graph.failure)
            self._refused.add(key)
        return hidden_states
