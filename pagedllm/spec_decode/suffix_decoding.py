"""SuffixDecodingProposer: suffix decoding (vLLM's ``suffix`` method, after Arctic Inference's SuffixDecoding).

Two sources count every run of up to ``max_tree_depth`` tokens: the request's own prompt and output so far, and a
global suffix tree over the outputs of the last ``max_cached_requests`` finished requests (a node per run, its
count the run's occurrences). To draft for a request, each source is searched for suffixes of the request's
tokens; from a suffix of length m that occurs, the draft follows the most frequent next token while the path's
probability (the product of child count / parent count) stays at least ``min_token_prob``, for at most
``max_spec_factor * m`` tokens (a longer match earns a longer draft) and the tree's depth. Of all match lengths in
both sources, the draft with the highest score (the sum of its tokens' path probabilities: its expected accepted
length) wins.

The request's own tokens are searched as they are, in the worker's token table, and only when the request gets
drafts: a run's occurrences are the positions where it ends, narrowed one token at a time as the match grows. So a
request costs nothing while dynamic speculation gives it no drafts, where a tree built as tokens arrive costs
O(depth) Python work per token, prompt included (a 64-request batch of 256-token prompts: ~400k nodes, seconds of
building and of the garbage collector walking them). The global tree is built once per
finished output; its nodes are integers into flat lists of counts and child maps (dicts of ints, which the
garbage collector does not track), so even a large tree adds nothing to a collection.
"""
from __future__ import annotations

from collections import deque

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.proposal_step import ProposalStep
from pagedllm.worker.input_batch import InputBatch

ROOT = 0


class SuffixTree:
    """Occurrence counts of every run of up to ``max_depth`` tokens of the sequences added. Nodes are indices:
    ``counts[node]`` is its run's count, ``children[node]`` maps a next token to the longer run's node."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.counts: list[int] = [0]
        self.children: list[dict[int, int]] = [{}]
        self._free: list[int] = []  # nodes whose run no longer occurs, for reuse

    def add(self, tokens: list[int]) -> None:
        ends: list[int] = []  # the nodes of the runs ending at the previous token, by length
        for token in tokens:
            longer = []
            for node in [ROOT] + ends:
                child = self.children[node].get(token)
                if child is None:
                    child = self.children[node][token] = self._new_node()
                self.counts[child] += 1
                longer.append(child)
            ends = longer[:self.max_depth - 1]

    def remove(self, tokens: list[int]) -> None:
        """Uncounts a sequence added before; a run left with no occurrence goes, its longer runs with it."""
        for start in range(len(tokens)):
            node = ROOT
            for token in tokens[start:start + self.max_depth]:
                child = self.children[node][token]
                self.counts[child] -= 1
                if self.counts[child] == 0:
                    del self.children[node][token]
                    self._release(child)
                    break
                node = child

    def find(self, run: list[int]) -> int | None:
        node = ROOT
        for token in run:
            node = self.children[node].get(token)
            if node is None:
                return None
        return node

    def count(self, run: list[int]) -> int:
        node = self.find(run)
        return 0 if node is None else self.counts[node]

    def draft_from(self, node: int, match_len: int, max_tokens: int, max_spec_factor: float,
                   min_token_prob: float) -> tuple[list[int], float]:
        """The most frequent path below ``node`` (the end of a match of ``match_len`` tokens) and its score."""
        limit = draft_limit(match_len, max_tokens, self.max_depth, max_spec_factor)
        draft, score, prob = [], 0.0, 1.0
        while len(draft) < limit and self.children[node]:
            token, child = max(self.children[node].items(), key=lambda item: self.counts[item[1]])
            prob *= self.counts[child] / self.counts[node]
            if prob < min_token_prob:
                break
            draft.append(token)
            score += prob
            node = child
        return draft, score

    def _new_node(self) -> int:
        if self._free:
            node = self._free.pop()
            self.counts[node] = 0
            return node
        self.counts.append(0)
        self.children.append({})
        return len(self.counts) - 1

    def _release(self, node: int) -> None:
        """``node`` and every node below it, for reuse (their runs counted only occurrences now removed)."""
        stack = [node]
        while stack:
            node = stack.pop()
            stack.extend(self.children[node].values())
            self.children[node] = {}
            self._free.append(node)


def draft_limit(match_len: int, max_tokens: int, max_depth: int, max_spec_factor: float) -> int:
    """The most tokens a match of ``match_len`` may draft: ``max_spec_factor`` times the match, within the tree's
    depth and ``max_tokens``. Each drafted token scores at most 1, so this also bounds the draft's score."""
    return min(max_tokens, int(match_len * max_spec_factor), max_depth - match_len)


def own_draft(tokens: list[int], max_tokens: int, max_depth: int, max_spec_factor: float,
              min_token_prob: float) -> tuple[list[int], float]:
    """The best draft from a sequence's own tokens, and its score: what a suffix tree over ``tokens`` (runs of up
    to ``max_depth``) would propose for the suffixes of ``tokens``, found by searching the tokens themselves.

    A run's node count is its number of occurrences, so the search keeps the positions where the match of the
    last m tokens ends (the last position among them), narrowed as m grows, and a step down a path keeps the
    occurrences followed by the chosen token. Matches are walked longest possible draft first, and one whose
    longest possible draft cannot beat the best score so far is not walked; of equal scores the shorter match wins,
    as in a tree searched by match length. Plain Python: the sets are small, where numpy's per-call cost would
    dominate."""
    length = len(tokens)
    matches = []  # (longest possible draft, match length, the match's end positions)
    last = tokens[-1]
    ends = [i for i, token in enumerate(tokens) if token == last]
    for match_len in range(1, min(max_depth, length)):
        if len(ends) < 2:  # the suffix itself only: no earlier occurrence of this match, nor of a longer one
            break
        matches.append((draft_limit(match_len, max_tokens, max_depth, max_spec_factor), match_len, ends))
        before = tokens[length - 1 - match_len]
        ends = [e for e in ends if e >= match_len and tokens[e - match_len] == before]
    best, best_score, best_len = [], 0.0, 0
    for limit, match_len, ends in sorted(matches, key=lambda match: (-match[0], match[1])):
        if limit < best_score or limit == best_score and match_len > best_len:
            break  # the limits only fall from here
        draft, score = _follow(tokens, ends, limit, min_token_prob)
        if score > best_score or score == best_score and draft and match_len < best_len:
            best, best_score, best_len = draft, score, match_len
    return best, best_score


def _follow(tokens: list[int], ends: list[int], limit: int, min_token_prob: float) -> tuple[list[int], float]:
    """The most frequent path after the occurrences ending at ``ends`` (ties: the token seen first, as a tree
    that adds tokens in order has its children), for at most ``limit`` tokens."""
    length = len(tokens)
    draft, score, prob = [], 0.0, 1.0
    while len(draft) < limit:
        following = [tokens[e + 1] for e in ends if e + 1 < length]
        if not following:
            break
        token = following[0]
        count = following.count(token)
        if count < len(following):  # the occurrences part ways: the most frequent token, the first seen of a tie
            counts: dict[int, int] = {}
            for t in following:
                counts[t] = counts.get(t, 0) + 1
            token, count = max(counts.items(), key=_count)
        prob *= count / len(ends)
        if prob < min_token_prob:
            break
        ends = [e + 1 for e in ends if e + 1 < length and tokens[e + 1] == token]
        if len(ends) == 1:  # one path left: every further token has this path probability
            rest = tokens[ends[0]:ends[0] + limit - len(draft)]
            for _ in rest:  # summed one by one, as a walk token by token rounds
                score += prob
            return draft + rest, score
        draft.append(token)
        score += prob
    return draft, score


def _count(item: tuple[int, int]) -> int:
    return item[1]


class SuffixDecodingProposer:
    def __init__(self, spec: SpeculativeConfig) -> None:
        self.max_depth = spec.suffix_decoding_max_tree_depth
        self.max_spec_factor = spec.suffix_decoding_max_spec_factor
        self.min_token_prob = spec.suffix_decoding_min_token_prob
        self.max_cached_requests = spec.suffix_decoding_max_cached_requests
        self.global_tree = SuffixTree(self.max_depth)
        self.cached_outputs: deque[list[int]] = deque()

    def propose_for_step(self, batch: InputBatch, step: ProposalStep) -> list[list[int]]:
        """Per sampling request of ``step``: its drafts, at most its max_drafts."""
        return [self._draft(batch.token_ids[row, :int(batch.num_tokens[row])].tolist(), limit) if limit > 0 else []
                for row, limit in zip(step.sample_rows.tolist(), step.max_drafts.tolist())]

    def cache_output(self, output_token_ids: list[int]) -> None:
        """A finished request's output joins the global tree (the oldest leaves it past max_cached_requests; with
        max_cached_requests 0 there is no global tree, as in vLLM)."""
        if not output_token_ids or not self.max_cached_requests:
            return
        output = list(output_token_ids)
        self.global_tree.add(output)
        self.cached_outputs.append(output)
        if len(self.cached_outputs) > self.max_cached_requests:
            self.global_tree.remove(self.cached_outputs.popleft())

    def _draft(self, tokens: list[int], max_tokens: int) -> list[int]:
        best, best_score = own_draft(tokens, max_tokens, self.max_depth, self.max_spec_factor, self.min_token_prob)
        if self.cached_outputs:
            pattern = tokens[-(self.max_depth - 1):]
            for match_len in range(1, len(pattern) + 1):
                node = self.global_tree.find(pattern[-match_len:])
                if node is None:  # no longer suffix occurs either
                    break
                if draft_limit(match_len, max_tokens, self.max_depth, self.max_spec_factor) <= best_score:
                    continue  # its longest possible draft, every token certain, could not beat the best
                draft, score = self.global_tree.draft_from(node, match_len, max_tokens, self.max_spec_factor,
                                                           self.min_token_prob)
                if score > best_score:
                    best, best_score = draft, score
        return best
