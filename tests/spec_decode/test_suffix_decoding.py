"""Suffix decoding: the trees count runs of tokens; drafts follow the most frequent continuation of the suffix that
scores best, within the probability threshold, the spec factor and the tree depth; a request's own tokens draft as
a tree over them would; finished outputs serve other requests until they are evicted."""
import numpy as np
import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.proposal_step import ProposalStep
from pagedllm.spec_decode.suffix_decoding import ROOT, SuffixDecodingProposer, SuffixTree, own_draft
from pagedllm.worker.input_batch import InputBatch


def test_tree_counts_runs_up_to_its_depth_and_removal_undoes_adding():
    tree = SuffixTree(max_depth=3)
    tree.add([1, 2, 1, 2, 3])
    assert tree.count([1, 2]) == 2 and tree.count([2, 1, 2]) == 1
    assert tree.count([1, 2, 3]) == 1 and tree.find([1, 2, 1, 2]) is None  # deeper than 3
    tree.add([1, 2, 3])
    assert tree.count([1, 2]) == 3 and tree.count([1, 2, 3]) == 2
    tree.remove([1, 2, 1, 2, 3])
    assert tree.count([1, 2, 3]) == 1 and tree.find([2, 1]) is None
    num_nodes = len(tree.counts)
    tree.remove([1, 2, 3])
    assert tree.children[ROOT] == {}
    tree.add([4, 5, 6])
    assert len(tree.counts) == num_nodes and tree.count([4, 5, 6]) == 1  # removed runs' nodes are reused


def test_draft_follows_the_most_frequent_path_while_likely_enough():
    tree = SuffixTree(max_depth=8)
    tree.add([5, 1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 4])
    node = tree.find([5, 1])
    # After "5 1": "2" every time (path probability 3/3), then "3" two times of three (2/3), then "5", "1", "2"
    # each time "5 1 2 3" went on (2/3 still), then "3" or "4" once each (1/3), the first seen winning the tie.
    path_probabilities = [1, 2 / 3, 2 / 3, 2 / 3, 2 / 3, 1 / 3]
    assert tree.draft_from(node, 2, max_tokens=10, max_spec_factor=4, min_token_prob=0.1) == (
        [2, 3, 5, 1, 2, 3], sum(path_probabilities))  # depth 8 - match 2 = 6 tokens at most
    assert tree.draft_from(node, 2, 10, 4, min_token_prob=0.5)[0] == [2, 3, 5, 1, 2]
    assert tree.draft_from(node, 2, 10, max_spec_factor=1, min_token_prob=0.1)[0] == [2, 3]  # 1 x the match
    assert tree.draft_from(node, 2, max_tokens=3, max_spec_factor=4, min_token_prob=0.1)[0] == [2, 3, 5]
    assert len(tree.draft_from(tree.find([5, 1, 2, 3, 5]), 5, 10, 4, 0.1)[0]) == 3  # depth 8 - match 5


def proposer(**overrides) -> SuffixDecodingProposer:
    values = {"method": "suffix", "suffix_decoding_max_tree_depth": 8, "suffix_decoding_max_spec_factor": 2.0}
    values.update(overrides)
    return SuffixDecodingProposer(SpeculativeConfig.from_dict(values))


@pytest.mark.parametrize("seed", range(40))
def test_a_sequences_own_draft_is_that_of_a_tree_over_it(seed):
    """own_draft searches the tokens themselves; it must propose what a tree built over them proposes (same
    draft, same score) for every suffix length, spec factor and threshold."""
    rng = np.random.default_rng(seed)
    motif = rng.integers(0, 6, size=rng.integers(2, 6))
    tokens = np.concatenate([np.where(rng.random(len(motif)) < 0.2, rng.integers(0, 6, len(motif)), motif)
                             for _ in range(rng.integers(1, 8))])[:rng.integers(1, 40)]
    depth, factor, min_prob = int(rng.integers(2, 10)), float(rng.choice([0.5, 1.0, 2.0])), float(rng.choice([0.1, 0.4]))
    max_tokens = int(rng.integers(1, 12))
    tree = SuffixTree(depth)
    tree.add(tokens.tolist())
    expected, expected_score = [], 0.0
    for match_len in range(1, min(depth, len(tokens)) + 1):
        draft, score = tree.draft_from(tree.find(tokens[-match_len:].tolist()), match_len, max_tokens, factor,
                                       min_prob)
        if score > expected_score:
            expected, expected_score = draft, score
    draft, score = own_draft(tokens.tolist(), max_tokens, depth, factor, min_prob)
    assert draft == expected and score == pytest.approx(expected_score)


class Batch:
    """An InputBatch holding ``requests`` (req_id -> (prompt, output)), and a step in which each samples."""

    def __init__(self, requests: dict[str, tuple[list[int], list[int]]]):
        self.batch = InputBatch(4, 64, 4, 100)
        for i, (req_id, (prompt, output)) in enumerate(requests.items()):
            tokens = prompt + output
            self.batch.req_ids.append(req_id)
            self.batch.req_id_to_index[req_id] = i
            self.batch.token_ids[i, :len(tokens)] = tokens
            self.batch.num_tokens[i] = len(tokens)
            self.batch.num_prompt_tokens[i] = len(prompt)

    def step(self, max_drafts: int = 8) -> ProposalStep:
        n = len(self.batch.req_ids)
        rows = np.arange(n)
        return ProposalStep(rows, np.zeros(n, dtype=np.int64), np.ones(n, dtype=np.int64), rows,
                            np.full(n, max_drafts))


def test_a_request_drafts_from_its_own_repetition_as_its_tokens_arrive():
    suffix = proposer()
    batch = Batch({"a": ([7, 8, 9, 10, 11, 3, 7, 8], [])})
    assert suffix.propose_for_step(batch.batch, batch.step()) == [[9, 10, 11, 3]]  # match 2 x factor 2
    assert suffix.propose_for_step(batch.batch, batch.step(max_drafts=1)) == [[9]]
    batch.batch.token_ids[0, 8] = 9
    batch.batch.num_tokens[0] = 9  # the draft's first token arrived: a match of 3 now
    assert suffix.propose_for_step(batch.batch, batch.step()) == [[10, 11, 3, 7, 8]]  # depth 8 - match 3


def test_finished_outputs_serve_other_requests_until_evicted():
    suffix = proposer(suffix_decoding_max_cached_requests=1)
    first = Batch({"a": ([1, 2], [40, 41, 42, 43, 44])})
    assert suffix.propose_for_step(first.batch, first.step()) == [[]]  # nothing repeats within "a"
    suffix.cache_output([40, 41, 42, 43, 44])  # "a" finished
    second = Batch({"b": ([3, 40, 41], [])})
    assert suffix.propose_for_step(second.batch, second.step()) == [[42, 43, 44]]
    suffix.cache_output([])  # "b" finished having output nothing: not cached, "a" stays
    third = Batch({"c": ([5, 6], [50, 51]), "d": ([40, 41], [])})
    assert suffix.propose_for_step(third.batch, third.step()) == [[], [42, 43, 44]]
    suffix.cache_output([50, 51])  # "c" finished: evicts "a"
    assert suffix.propose_for_step(third.batch, third.step()) == [[], []]


def test_no_cached_requests_is_vllms_request_only_suffix_decoding_and_a_zero_factor_drafts_nothing():
    """vLLM's suffix_decoding_max_cached_requests 0: no global tree, the request's own tokens still draft;
    suffix_decoding_max_spec_factor 0 (vLLM's lower bound too): every match may draft 0 tokens."""
    suffix = proposer(suffix_decoding_max_cached_requests=0)
    suffix.cache_output([40, 41, 42, 43, 44])
    batch = Batch({"b": ([3, 40, 41], []), "a": ([7, 8, 9, 10, 11, 3, 7, 8], [])})
    assert suffix.propose_for_step(batch.batch, batch.step()) == [[], [9, 10, 11, 3]]
    assert suffix.global_tree.children[ROOT] == {}
    suffix = proposer(suffix_decoding_max_spec_factor=0)
    suffix.cache_output([40, 41, 42, 43, 44])
    assert suffix.propose_for_step(batch.batch, batch.step()) == [[], []]
