"""Steps replayed from CPU graphs (native/graph.py): per step shape, static input buffers and the graphs captured
over them, as vLLM's model runner keeps CUDA graphs per batch size. A step's shape is its number of requests, of
tokens and of decode rows. A plain decode step has one token per request, all decode rows (the decode kernel's). A
step with prompt chunks has its decode rows first (the model runner orders them so) and then each chunk; a verify
step of speculative decoding has a request's drafts after its token, and no decode rows: each of its requests is a
chunk. Chunks go to the native prefill kernel, which reads each one's query start and length from static buffers
when it runs, so one graph serves any split of the chunks' tokens. A graph is also keyed by how long a prefix all
its requests share, when attention takes that prefix once for all rows (cascade attention): the kernels' arguments
differ with it; and by whether adapters run (multi-LoRA), since the LoRA'd layers launch their kernel only in steps
with adapters. Which adapter each token takes is an input, read from a static buffer like the token ids, so one
graph serves any mix of adapters; a step with an adapter on the token embedding runs eagerly (that LoRA's lookup is
torch ops: PunicaWrapper.needs_eager). A step's decode rows are padded to a bucket (1, 2, 4, 8, then multiples of 8) by
rows before them, and a step with prompt chunks to whole blocks of tokens by one more chunk; padding rows write and
read only a padding block past the scheduler's (as CUDA graphs pad a batch to a captured size), so that batches of
nearby sizes and prompts of nearby lengths share a shape; the first step of a shape among many (chunks beside
decode rows) runs eagerly, and the shapes kept are bounded (MAX_GRAPH_SHAPES), so one-off shapes cost no capture
and graphs no unbounded memory.

Steps of up to MAX_GRAPH_BATCH requests and MAX_GRAPH_TOKENS tokens use graphs. The graphs share one pool for
their activations (what one forward has live at once: a few MB), which also spares replays the allocations an
eager step makes. A replay drops the Python around the kernels, which costs about as much as the kernels at one
row and still a visible share of a prompt's step, so graphs pay at every size up to the cap. Larger steps run
eagerly, and so does any key whose capture was refused (e.g. cascade attention on torch's SDPA where the native
prefix kernel does not apply, or chunks where the native prefill tiles do not); after a refused step with prompt
chunks, larger ones run eagerly without trying (a layer whose native kernel gives way to torch's past some rows).
"""

import logging
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch

from pagedllm.layers.attention.cpu_plan import shared_prefix_tokens
from pagedllm.layers.attention.metadata import AttentionMetadata
from pagedllm.lora.punica import PunicaWrapper
from pagedllm.native.graph import CpuGraph, GraphPool, GraphReplayError

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 64
MAX_GRAPH_TOKENS = 512
MAX_GRAPH_SHAPES = 128  # step shapes whose static buffers and graphs (their calls, packed) are kept
DECODE_BUCKETS = (1, 2, 4, 8)  # then multiples of 8: the decode rows a padded step has (vLLM's capture sizes)


def decode_bucket(num_decodes: int) -> int:
    """The decode rows a step of ``num_decodes`` is padded to: the first of DECODE_BUCKETS, or multiple of 8 past
    them, that holds them (0 stays 0). StepGraphs pads no further than MAX_GRAPH_BATCH rows."""
    return next((b for b in (0, *DECODE_BUCKETS) if b >= num_decodes), -(-num_decodes // 8) * 8)


def cpu_graphs_apply(model_config, model, world_size: int = 1) -> bool:
    """Whether steps of ``model`` (of ``model_config``) replay CPU graphs. A graph replays kernels, not
    collectives: more than one rank runs every step eagerly; so does a model whose step computes with torch ops
    between the kernels (a capture would be refused at every shape), one off the CPU, and one whose attention is not
    the CPU backend's (its kernels are what a graph replays)."""
    return (not model_config.enforce_eager and world_size == 1 and model.supports_cpu_graphs
            and model_config.device == "cpu" and model_config.attention_backend == "TORCH_SDPA")


class Step(NamedTuple):
    """A step's inputs as the model runner builds them: its tokens' ids and positions, its requests' lengths after the
    step and query starts, and per KV cache group the tokens' cache slots and the requests' block table."""
    input_ids: np.ndarray
    positions: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    tables: list[tuple[np.ndarray, np.ndarray]]


def _joined(first: Step, second: Step) -> Step:
    """One step of ``first``'s requests, then ``second``'s."""
    return Step(np.concatenate([first.input_ids, second.input_ids]),
                np.concatenate([first.positions, second.positions]),
                np.concatenate([first.seq_lens, second.seq_lens]),
                np.concatenate([first.query_start_loc, second.query_start_loc[1:] + first.query_start_loc[-1]]),
                [(np.concatenate([slots, more_slots]), np.concatenate([table, more_table]))
                 for (slots, table), (more_slots, more_table) in zip(first.tables, second.tables, strict=True)])


class _StaticInputs:
    """The tensors the graphs of steps of ``num_reqs`` requests, ``num_tokens`` tokens and ``num_decodes`` decode
    rows read their step's inputs from, in the same memory every step: a slot mapping and a block table per KV cache
    group (core/kv_cache_groups.py). A block table holds every request's full width, so a history growing by a block
    changes no shape."""

    def __init__(self, num_reqs: int, num_tokens: int, num_decodes: int, block_table_width: int, num_groups: int):
        self.input_ids = torch.zeros(num_tokens, dtype=torch.int64)
        self.positions = torch.zeros(num_tokens, dtype=torch.int64)
        self.tables = [(torch.zeros(num_tokens, dtype=torch.int64),
                        torch.zeros(num_reqs, block_table_width, dtype=torch.int32)) for _ in range(num_groups)]
        self.token_slots = torch.full((num_tokens,), -1, dtype=torch.int64)  # each token's adapter slot (LoRA)
        self.seq_lens = torch.zeros(num_reqs, dtype=torch.int32)
        self.query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int64)
        self.num_decodes = num_decodes
        # The chunks after the decode rows, as the native prefill kernel reads them; a decode step has none.
        self.chunk_query_start = self.chunk_query_len = None
        if num_decodes < num_reqs:
            self.chunk_query_start = torch.zeros(num_reqs - num_decodes, dtype=torch.int32)
            self.chunk_query_len = torch.zeros(num_reqs - num_decodes, dtype=torch.int32)
        self.graphs: dict[tuple[int, bool], CpuGraph] = {}  # by shared prefix tokens and whether adapters run

    def fill(self, step: Step) -> None:
        self.input_ids.numpy()[:] = step.input_ids
        self.positions.numpy()[:] = step.positions
        for (slots, table), (step_slots, step_table) in zip(self.tables, step.tables, strict=True):
            slots.numpy()[:] = step_slots
            table.numpy()[:] = step_table
        self.seq_lens.numpy()[:] = step.seq_lens
        if self.chunk_query_len is not None:
            self.query_start_loc.numpy()[:] = step.query_start_loc
            self.chunk_query_start.numpy()[:] = step.query_start_loc[self.num_decodes:-1]
            self.chunk_query_len.numpy()[:] = np.diff(step.query_start_loc[self.num_decodes:])

    def metadata(self) -> AttentionMetadata:
        max_query_len = 1 if self.chunk_query_len is None else int(self.chunk_query_len.max())
        slot_mapping, block_table = self.tables[0]
        return AttentionMetadata(num_actual_tokens=self.input_ids.shape[0], slot_mapping=slot_mapping,
                                 query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                                 block_table=block_table, max_query_len=max_query_len,
                                 max_seq_len=int(self.seq_lens.max()), chunk_query_start=self.chunk_query_start,
                                 chunk_query_len=self.chunk_query_len,
                                 num_decodes=self.num_decodes if self.chunk_query_len is not None else 0
                                 ).with_groups(self.tables)


class StepGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, block_size: int, block_table_width: int,
                 padding_block: int | None = None, num_groups: int = 1):
        """``padding_block``: a block of ``kv_caches`` no request holds, for the rows padding steps (None: steps
        keep their own shape). ``num_groups``: the model's KV cache groups (core/kv_cache_groups.py)."""
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.block_table_width = block_size, block_table_width
        self.padding_block = padding_block
        self.num_groups = num_groups
        # By (requests, tokens, decode rows), least recently used first; and the shapes seen once, not yet kept.
        self._by_shape: OrderedDict[tuple[int, int, int], _StaticInputs] = OrderedDict()
        self._seen_once: OrderedDict[tuple[int, int, int], None] = OrderedDict()
        self._pool = GraphPool()
        # (requests, tokens, decode rows, shared prefix, adapters run)
        self._refused: set[tuple[int, int, int, int, bool]] = set()
        self._chunk_tokens_refused = MAX_GRAPH_TOKENS + 1  # the fewest tokens of a refused step with prompt chunks
        self.captured = False  # whether the last forward captured a graph (its time is no step's)

    def forward(self, step: Step, punica: PunicaWrapper | None = None, num_decodes: int | None = None
                ) -> torch.Tensor | None:
        """Final hidden states ``[tokens, hidden]`` of ``step``, from the graph of its key, captured now if this is its
        first step (of a shape among many: since its shape was seen before, see _static_inputs); None where no graph
        serves the step (such a shape's first step, too many requests or tokens, an adapter on the token embedding, or
        its capture was refused). Its first ``num_decodes`` requests are one-row decodes (None: all of them, a decode
        step), every later one a chunk for the prefill kernel: a verify step's (0 decodes: each request's last token,
        then its drafts) or a prompt's. The result is in the graphs' shared pool: the next graph step overwrites it.
        With adapters in the step (``punica`` active), its tokens' slots move into the static buffer the LoRA kernels
        read, and the graph is one captured with them."""
        num_reqs, num_tokens = len(step.seq_lens), len(step.input_ids)
        num_decodes = num_reqs if num_decodes is None else num_decodes
        self.captured = False
        if punica is not None and punica.needs_eager:
            return None
        prefix = 0
        if num_reqs > 1:
            slot_mapping, block_table = step.tables[0]
            prefix = shared_prefix_tokens(AttentionMetadata(
                num_tokens, torch.from_numpy(slot_mapping), torch.from_numpy(step.query_start_loc),
                torch.from_numpy(step.seq_lens), torch.from_numpy(block_table), 0, 0), self.block_size)
        # A step whose requests share a prefix that cascade attention takes once keeps its shape: padding rows,
        # sharing none of it, would turn that off.
        lead = 0  # padding decode rows before the step's own
        if self.padding_block is not None and not prefix:
            lead = min(decode_bucket(num_decodes), max(num_decodes, MAX_GRAPH_BATCH)) - num_decodes
            if lead:
                step = self._lead_decodes(step, lead)
                num_decodes += lead
            if num_decodes < len(step.seq_lens):
                step = self._padded(step)
        hidden_states = self._forward(step, punica, num_decodes, prefix, lead)
        return None if hidden_states is None else hidden_states[lead:lead + num_tokens]

    @torch.inference_mode()
    def capture_decode_steps(self, max_rows: int) -> int:
        """Captures the graphs of decode steps of every bucket (decode_bucket) up to ``max_rows`` (the most
        requests a step has) or MAX_GRAPH_BATCH rows, as vLLM captures its CUDA graphs at start-up, so that no
        request's decode waits for a capture (which costs several times a decode step's kernels); returns how many
        were captured (a refused one is logged, and its steps run eagerly). Their rows are padding rows, in the
        padding block; none without one (steps then keep their own shape). Captured without running their kernels
        (CpuGraph's run_kernels): nothing reads what these forwards would compute, and computing it was most of
        an engine's start-up."""
        if self.padding_block is None:
            return 0
        buckets = sorted({min(decode_bucket(rows), MAX_GRAPH_BATCH) for rows in range(1, max_rows + 1)})
        for rows in buckets:
            self._forward(self._padding_step(np.ones(rows, dtype=np.int64)), None, rows, 0, rows,
                          run_kernels=False)
        return sum((rows, rows, rows, 0, False) not in self._refused for rows in buckets)

    def _padding_step(self, query_lens: np.ndarray) -> Step:
        """Padding requests of ``query_lens`` tokens each (at most a block's), at positions 0 .., which write their
        keys and values to the padding block (past the scheduler's, and every KV cache group's, blocks) and attend to
        them alone."""
        num_tokens = int(query_lens.sum())
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int64)
        query_start_loc[1:] = np.cumsum(query_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start_loc[:-1], query_lens)
        rows = np.zeros((len(query_lens), self.block_table_width), dtype=np.int32)
        rows[:, 0] = self.padding_block
        return Step(np.zeros(num_tokens, dtype=np.int64), positions, query_lens.astype(np.int32), query_start_loc,
                    [(self.padding_block * self.block_size + positions, rows)] * self.num_groups)

    def _lead_decodes(self, step: Step, lead: int) -> Step:
        """The step with ``lead`` padding decode rows before its own, so that its decode rows fill a bucket
        (decode_bucket)."""
        return _joined(self._padding_step(np.ones(lead, dtype=np.int64)), step)

    def _padded(self, step: Step) -> Step:
        """A step with prompt chunks padded to whole blocks of tokens by one more chunk of padding rows, so that
        prompts of nearby lengths share a shape, and a graph. Unchanged where it is whole blocks already."""
        pad = -len(step.input_ids) % self.block_size
        return step if pad == 0 else _joined(step, self._padding_step(np.array([pad])))

    def _forward(self, step: Step, punica: PunicaWrapper | None, num_decodes: int, prefix: int, lead: int,
                 run_kernels: bool = True) -> torch.Tensor | None:
        """forward's step as given (padded or not), ``prefix`` the tokens its requests share for cascade attention
        (0 for a padded step), ``lead`` its padding decode rows before the step's own; ``run_kernels``: whether a
        capture computes the step (False: only records its graph, for steps to come)."""
        num_reqs, num_tokens = len(step.seq_lens), len(step.input_ids)
        if num_reqs > MAX_GRAPH_BATCH or num_tokens > MAX_GRAPH_TOKENS:
            return None
        shape = (num_reqs, num_tokens, num_decodes)
        static = self._static_inputs(shape)
        if static is None:
            return None
        static.fill(step)
        metadata = static.metadata()
        lora = punica is not None and punica.active
        key = (*shape, prefix, lora)
        if key in self._refused or (num_decodes < num_reqs and num_tokens >= self._chunk_tokens_refused):
            return None
        if lora:  # the padding rows, if any, take none (an eager step, above, keeps the step's own slots)
            static.token_slots.fill_(-1)
            static.token_slots[lead:lead + len(punica.token_slots)].copy_(punica.token_slots)
            punica.update(static.token_slots)
        graph = static.graphs.get(key[3:])
        if graph is not None:
            return self._replay(static, key)
        graph = CpuGraph(self._pool)
        self.captured = True
        hidden_states = graph.capture(lambda: self.model(static.input_ids, static.positions, self.kv_caches,
                                                         metadata), run_kernels)
        if graph.failure is None:
            static.graphs[key[3:]] = graph
        else:
            logger.info("Steps of %d requests, %d tokens and %d decode rows (shared prefix %d tokens, adapters %s) "
                        "run eagerly: their CPU graph was refused (%s)", *key, graph.failure)
            self._refused.add(key)
            if num_decodes < num_reqs and not prefix and not lora:
                # Usually a layer whose native kernel gives way to torch's past some rows: steps with prompt chunks
                # as large or larger run eagerly without trying.
                self._chunk_tokens_refused = min(self._chunk_tokens_refused, num_tokens)
        return hidden_states

    def _replay(self, static: _StaticInputs, key: tuple) -> torch.Tensor | None:
        """The replay of ``static``'s graph of ``key``; None (the step runs eagerly, and the key's steps from then
        on) where it was captured without its kernels and a kernel refuses its arguments at this first run."""
        graph = static.graphs[key[3:]]
        try:
            return graph.replay()
        except GraphReplayError as e:
            if graph.verified:
                raise
            logger.info("Steps of %d requests, %d tokens and %d decode rows (shared prefix %d tokens, adapters %s) "
                        "run eagerly: their CPU graph failed its first replay (%s)", *key, e)
            del static.graphs[key[3:]]
            self._refused.add(key)
            return None

    def _static_inputs(self, shape: tuple[int, int, int]) -> _StaticInputs | None:
        """The static buffers (and graphs) of steps of ``shape``; None for the first step of a shape among many,
        which runs eagerly: a shape seen once (prompt chunks of new lengths beside so many decodes) may not come
        again, and a capture costs more than the eager step. Shapes of which there are few capture at once: a
        decode step's (one per batch size) and one of at most two chunks and no decode rows (one per token count:
        a lone prompt, its padding chunk beside it). At most MAX_GRAPH_SHAPES shapes are kept, the least recently
        used dropped first."""
        static = self._by_shape.get(shape)
        if static is not None:
            self._by_shape.move_to_end(shape)
            return static
        num_reqs, _, num_decodes = shape
        few = num_decodes == num_reqs or (num_decodes == 0 and num_reqs <= 2)
        if not few and shape not in self._seen_once:
            self._seen_once[shape] = None
            if len(self._seen_once) > MAX_GRAPH_SHAPES:
                self._seen_once.popitem(last=False)
            return None
        self._seen_once.pop(shape, None)
        static = self._by_shape[shape] = _StaticInputs(*shape, self.block_table_width, self.num_groups)
        if len(self._by_shape) > MAX_GRAPH_SHAPES:
            dropped, _ = self._by_shape.popitem(last=False)
            self._refused = {key for key in self._refused if key[:3] != dropped}
        return static
