"""SuffixDecodingProposer: suffix decoding (vLLM's ``suffix`` method, after Arctic Inference's SuffixDecoding).

Two kinds of suffix tree count every run of up to ``max_tree_depth`` tokens (a node per run, its count the run's
occurrences): one per request over its prompt and output so far, and one global tree over the outputs of the last
``max_cached_requests`` finished requests. To draft for a request, each tree is searched for suffixes of the
request's tokens; from a suffix of length m that occurs, the draft follows the most frequent next token while the
path's probability (the product of child count / parent count) stays at least ``min_token_prob``, for at most
``max_spec_factor * m`` tokens (a longer match earns a longer draft) and the tree's depth. Of all match lengths in
both trees, the draft with the highest score (the sum of its tokens' path probabilities: its expected accepted
length) wins.

A request's tree is built as its tokens arrive (each token extends the runs that end at the previous one: O(depth)
per token), so a request's own repetitions (code edits, lists, templated text) are found at once and other
requests' outputs (agent loops, repeated queries) once they finish.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.proposal_step import ProposalStep
from pagedllm.worker.input_batch import InputBatch


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """Occurrence counts of every run of up to ``max_depth`` tokens of the sequences added."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()

    def extend(self, ends: list[_Node], token: int) -> list[_Node]:
        """One more token of a sequence whose runs ending at its last token are ``ends`` (by length, 1 up to
        max_depth - 1): counts the runs ending at ``token`` and returns them, the longest dropped."""
        longer = []
        for node in [self.root] + ends:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
            child.count += 1
            longer.append(child)
        return longer[:self.max_depth - 1]

    def add(self, tokens: list[int]) -> None:
        ends: list[_Node] = []
        for token in tokens:
            ends = self.extend(ends, token)

    def remove(self, tokens: list[int]) -> None:
        """Uncounts a sequence added before; a run left with no occurrence goes, its longer runs with it."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    break
                node = child

    def find(self, run: list[int]) -> _Node | None:
        node = self.root
        for token in run:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def draft_from(self, node: _Node, match_len: int, max_tokens: int, max_spec_factor: float,
                   min_token_prob: float) -> tuple[list[int], float]:
        """The most frequent path below ``node`` (the end of a match of ``match_len`` tokens) and its score."""
        limit = min(max_tokens, int(match_len * max_spec_factor), self.max_depth - match_len)
        draft, score, prob = [], 0.0, 1.0
        while len(draft) < limit and node.children:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / node.count
            if prob < min_token_prob:
                break
            draft.append(token)
            score += prob
            node = child
        return draft, score


@dataclass
class _RequestState:
    tree: SuffixTree
    num_prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    ends: list[_Node] = field(default_factory=list)  # the request's runs ending at its last token, by length


class SuffixDecodingProposer:
    def __init__(self, spec: SpeculativeConfig) -> None:
        self.max_depth = spec.suffix_decoding_max_tree_depth
        self.max_spec_factor = spec.suffix_decoding_max_spec_factor
        self.min_token_prob = spec.suffix_decoding_min_token_prob
        self.max_cached_requests = spec.suffix_decoding_max_cached_requests
        self.global_tree = SuffixTree(self.max_depth)
        self.cached_outputs: deque[list[int]] = deque()
        self.requests: dict[str, _RequestState] = {}

    def propose_for_step(self, batch: InputBatch, step: ProposalStep) -> list[list[int]]:
        """Per sampling request of ``step``: its drafts, at most its max_drafts (its tree takes its new tokens
        whether it gets drafts or not)."""
        drafts = []
        for row, limit in zip(step.sample_rows.tolist(), step.max_drafts.tolist()):
            state = self._caught_up(batch, row)
            drafts.append(self._draft(state, limit) if limit > 0 else [])
        return drafts

    def finish_requests(self, req_ids) -> None:
        """Finished requests' outputs join the global tree (the oldest leave it past max_cached_requests)."""
        for req_id in req_ids:
            state = self.requests.pop(req_id, None)
            if state is None or len(state.tokens) == state.num_prompt_tokens:
                continue
            output = state.tokens[state.num_prompt_tokens:]
            self.global_tree.add(output)
            self.cached_outputs.append(output)
            if len(self.cached_outputs) > self.max_cached_requests:
                self.global_tree.remove(self.cached_outputs.popleft())

    def _caught_up(self, batch: InputBatch, row: int) -> _RequestState:
        req_id = batch.req_ids[row]
        state = self.requests.get(req_id)
        if state is None:
            state = self.requests[req_id] = _RequestState(SuffixTree(self.max_depth),
                                                          int(batch.num_prompt_tokens[row]))
        new_tokens = batch.token_ids[row, len(state.tokens):int(batch.num_tokens[row])].tolist()
        for token in new_tokens:
            state.ends = state.tree.extend(state.ends, token)
        state.tokens.extend(new_tokens)
        return state

    def _draft(self, state: _RequestState, max_tokens: int) -> list[int]:
        best, best_score = [], 0.0
        # The request's own tree: its runs ending at its last token are the matches, one per length.
        for match_len, node in enumerate(state.ends, 1):
            draft, score = state.tree.draft_from(node, match_len, max_tokens, self.max_spec_factor,
                                                 self.min_token_prob)
            if score > best_score:
                best, best_score = draft, score
        if self.cached_outputs:
            pattern = state.tokens[-(self.max_depth - 1):]
            for match_len in range(1, len(pattern) + 1):
                node = self.global_tree.find(pattern[-match_len:])
                if node is None:  # no longer suffix occurs either
                    break
                draft, score = self.global_tree.draft_from(node, match_len, max_tokens, self.max_spec_factor,
                                                           self.min_token_prob)
                if score > best_score:
                    best, best_score = draft, score
        return best
