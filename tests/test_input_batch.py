"""The persistent InputBatch against a plain model of what it holds: after any sequence of adds, removals, sampled
tokens and new blocks, every request's row holds exactly its own tokens, blocks (in each of two KV cache groups) and
sampling settings, and the rows stay dense (0 .. num_reqs - 1) however requests leave."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import ReasoningConfig
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import CachedRequestState, InputBatch

MAX_REQS, MAX_LEN, MAX_BLOCKS, BLOCK = 6, 64, 16, 4
GROUPS = 2  # KV cache groups: a block table each (a hybrid model's)


def _state(req_id: str, seed: int) -> CachedRequestState:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 1000, int(rng.integers(1, 20))).tolist()
    params = SamplingParams(temperature=float(rng.uniform(0.1, 2.0)), top_p=float(rng.uniform(0.1, 1.0)),
                            top_k=int(rng.integers(0, 50)), repetition_penalty=float(rng.uniform(1.0, 2.0)),
                            max_tokens=8)
    blocks = tuple(rng.integers(0, 500, -(-len(prompt) // BLOCK)).tolist() for _ in range(GROUPS))
    return CachedRequestState(req_id, prompt, params, None, blocks, int(rng.integers(0, len(prompt))))


def _check(batch: InputBatch, expected: dict[str, CachedRequestState]) -> None:
    assert batch.num_reqs == len(expected) == len(batch.states)
    assert sorted(batch.req_ids) == sorted(expected)
    assert batch.req_id_to_index == {req_id: row for row, req_id in enumerate(batch.req_ids)}
    for row, req_id in enumerate(batch.req_ids):
        state = expected[req_id]
        assert batch.states[row] is state
        tokens = state.prompt_token_ids + state.output_token_ids
        assert batch.num_tokens[row] == len(tokens) and batch.num_prompt_tokens[row] == len(state.prompt_token_ids)
        assert batch.token_ids[row, :len(tokens)].tolist() == tokens
        for table, block_ids in zip(batch.block_tables, state.block_ids, strict=True):
            assert batch.num_blocks[row] == len(block_ids)
            assert table[row, :len(block_ids)].tolist() == block_ids
        assert batch.num_computed_tokens[row] == state.num_computed_tokens
        params = state.sampling_params
        assert batch.temperature[row] == np.float32(params.temperature)
        assert batch.top_p[row] == np.float32(params.top_p) and batch.top_k[row] == params.top_k
        assert batch.repetition_penalties[row] == np.float32(params.repetition_penalty)


OPS = st.lists(st.tuples(st.sampled_from(["add", "remove", "token", "blocks"]), st.integers(0, 10**6)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_rows_stay_consistent_under_random_adds_and_removals(ops):
    batch = InputBatch(MAX_REQS, MAX_LEN, MAX_BLOCKS, vocab_size=1000, num_kv_cache_groups=GROUPS)
    expected: dict[str, CachedRequestState] = {}
    next_id = 0
    for op, value in ops:
        live = list(expected)
        if op == "add" and len(expected) < MAX_REQS:
            state = expected[f"r{next_id}"] = _state(f"r{next_id}", value)
            next_id += 1
            batch.add_request(state)
        elif op == "remove" and live:
            req_id = live[value % len(live)]
            del expected[req_id]
            batch.remove_request(req_id)
        elif op == "token" and live:
            state = expected[live[value % len(live)]]
            if state.num_tokens < MAX_LEN:
                batch.append_token(batch.req_id_to_index[state.req_id], value % 1000)
        elif op == "blocks" and live:
            state = expected[live[value % len(live)]]
            if len(state.block_ids[0]) < MAX_BLOCKS:
                new = ([value % 500], [value % 499])
                for block_ids, new_ids in zip(state.block_ids, new):
                    block_ids.extend(new_ids)  # as the model runner keeps its state and the batch in step
                batch.append_block_ids(batch.req_id_to_index[state.req_id], new)
        _check(batch, expected)


def test_removing_a_row_moves_only_the_last_row_into_it():
    batch = InputBatch(MAX_REQS, MAX_LEN, MAX_BLOCKS, vocab_size=1000, num_kv_cache_groups=GROUPS)
    states = [_state(f"r{i}", i) for i in range(4)]
    for state in states:
        batch.add_request(state)
    batch.remove_request("r1")
    assert batch.req_ids == ["r0", "r3", "r2"]
    batch.remove_request("r2")  # the last row: nothing moves
    assert batch.req_ids == ["r0", "r3"]
    _check(batch, {s.req_id: s for s in (states[0], states[3])})


def test_a_full_batch_and_a_duplicate_are_refused():
    batch = InputBatch(2, MAX_LEN, MAX_BLOCKS, vocab_size=1000, num_kv_cache_groups=GROUPS)
    batch.add_request(_state("a", 0))
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add_request(_state("a", 1))
    batch.add_request(_state("b", 2))
    with pytest.raises(RuntimeError, match="full"):
        batch.add_request(_state("c", 3))


THINK, END = 7, 8  # one-token reasoning markers


def _thinking_batch(*requests: tuple[list[int], list[int], int | None], forced_end: tuple[int, ...] = (END,)
                    ) -> InputBatch:
    """A batch of requests (prompt, output, thinking_token_budget) under a reasoning config with those markers, and
    ``forced_end`` what a spent budget forces."""
    batch = InputBatch(MAX_REQS, MAX_LEN, MAX_BLOCKS, vocab_size=1000,
                       reasoning_config=ReasoningConfig("deepseek_r1", (THINK,), forced_end, (END,)))
    for i, (prompt, output, budget) in enumerate(requests):
        state = CachedRequestState(f"r{i}", prompt, SamplingParams(thinking_token_budget=budget), None, ([],),
                                   len(prompt) + len(output), output_token_ids=list(output))
        batch.add_request(state)
    return batch


def _forced(batch: InputBatch, rows: list[int], offsets: list[int] | None = None) -> dict[int, int]:
    return batch.make_sampling_metadata(np.array(rows), None if offsets is None else np.array(offsets)
                                        ).forced_token_ids


def test_a_spent_thinking_budget_forces_the_end_marker_once_per_section():
    """vLLM's thinking_token_budget: the tokens after the last <think> that no </think> closed (the prompt's count)
    reach the budget -> </think> is forced; a request without a budget, or whose thinking is closed, is left be."""
    batch = _thinking_batch(([1, THINK, 2], [3], 2),  # thought 2 of 2
                            ([1, THINK, 2], [3], None),  # no budget
                            ([1, THINK, 2], [], 2),  # thought 1 of 2
                            ([THINK], [], 0),  # a budget of 0 forces the first token
                            ([1, THINK, 2, END, 3], [4, 5], 1),  # thinking over
                            ([1, THINK, 2, END], [THINK, 5], 1))  # a new section, with a whole budget
    assert _forced(batch, list(range(6))) == {0: END, 3: END, 5: END}
    batch.append_token(2, 3)  # the scan goes on from where it stopped
    batch.append_token(5, END)
    assert _forced(batch, [2, 5]) == {0: END}


def test_drafts_count_as_thoughts_and_a_multi_token_end_is_forced_token_by_token():
    """Speculative decoding: each logits row sees the drafts before it (offsets) as thought, or as the end of the
    thinking. A forced end of several tokens (vLLM's reasoning_end_str, a phrase ending in </think>) is forced one a
    step, from where the tokens already are in it; the model's own </think> ends the thinking all the same."""
    batch = _thinking_batch(([1, THINK], [2], 2), ([1, THINK], [2], 2))
    batch.set_draft_tokens(0, [3, 4, 5])
    batch.set_draft_tokens(1, [3, END, 4])
    assert _forced(batch, [0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 2, 3, 0, 1, 2, 3]) == {1: END, 2: END, 3: END, 5: END}
    multi = _thinking_batch(([1, THINK, 2], [3], 2), ([1, THINK, 2], [3, 60], 2), ([1, THINK, 2], [3, 60, 61], 2),
                            ([1, THINK, 2], [3, END], 2), forced_end=(60, 61, END))
    assert _forced(multi, [0, 1, 2, 3]) == {0: 60, 1: 61, 2: END}
