"""Logits changes applied before sampling, all batched over rows: allowed_token_ids, bad_words, min_tokens,
logit_bias (per-request token lists) and forced tokens (thinking_token_budget), then top-k, top-p and min-p.

Masks set the dropped tokens to -inf, in place; none loops over the vocabulary in Python.
"""
from __future__ import annotations

import torch


def apply_allowed_token_ids(logits: torch.Tensor, allowed_token_ids: dict[int, torch.Tensor]) -> torch.Tensor:
    """Drop every token outside each row's allowed_token_ids. In place; rows without the knob are untouched."""
    if not allowed_token_ids:
        return logits
    rows = torch.tensor(list(allowed_token_ids))
    token_ids = list(allowed_token_ids.values())
    allowed = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool)
    allowed[_repeat_rows(torch.arange(len(rows)), token_ids), torch.cat(token_ids)] = True
    logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))
    return logits


def apply_bad_words(logits: torch.Tensor, bad_words_token_ids: dict[int, list[list[int]]],
                    output_token_ids: list[list[int]]) -> torch.Tensor:
    """Drop the token that would complete a bad word: a one-token word always, a longer one when the row's
    output ends with the rest of it. In place. Loops over each row's bad words, as vLLM does."""
    pairs = []
    for row, bad_words in bad_words_token_ids.items():
        past = output_token_ids[row]
        for word in bad_words:
            prefix_len = len(word) - 1
            if prefix_len <= len(past) and past[len(past) - prefix_len:] == word[:-1]:
                pairs.append((row, word[-1]))
    return _drop(logits, pairs)


def apply_min_tokens(logits: torch.Tensor, min_tokens_mask: dict[int, set[int]],
                     restorable: frozenset[int] = frozenset()) -> torch.Tensor:
    """Suppress EOS/stop tokens of rows still under min_tokens, so they cannot end the request early. A row of
    ``restorable`` (one a grammar or allowed_token_ids may leave with nothing else) that has no token left gets its
    stop tokens back, as vLLM restores them for structured output: it ends rather than sample a token nothing
    allows. Only those rows are looked at, one reduction each (a whole row per masked token cost a step dearly).
    In place."""
    if not min_tokens_mask:
        return logits
    kept = {row: [(token_id, logits[row, token_id].item()) for token_id in token_ids]
            for row, token_ids in min_tokens_mask.items() if row in restorable}
    _drop(logits, [(row, token_id) for row, token_ids in min_tokens_mask.items() for token_id in token_ids])
    for row, stops in kept.items():
        if logits[row].max().item() == float("-inf"):
            for token_id, value in stops:
                logits[row, token_id] = value
    return logits


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, tuple[torch.Tensor, torch.Tensor]]
                     ) -> torch.Tensor:
    """Add each row's logit_bias to its tokens. In place."""
    if not logit_bias:
        return logits
    token_ids, biases = zip(*logit_bias.values())
    rows = _repeat_rows(torch.tensor(list(logit_bias)), token_ids)
    return logits.index_put_((rows, torch.cat(token_ids)), torch.cat(biases), accumulate=True)


# vLLM's thinking-budget logit: above any other, so the token wins the argmax and takes the whole softmax.
FORCED_LOGIT = 1e9


def apply_forced_tokens(logits: torch.Tensor, forced_token_ids: dict[int, int]) -> torch.Tensor:
    """Each row of ``forced_token_ids`` samples its token, greedy or random: its logit set to FORCED_LOGIT, as
    vLLM's thinking budget forces the end of the reasoning. In place."""
    if forced_token_ids:
        logits[torch.tensor(list(forced_token_ids)), torch.tensor(list(forced_token_ids.values()))] = FORCED_LOGIT
    return logits


def _drop(logits: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    if pairs:
        rows, cols = zip(*pairs)
        logits[rows, cols] = float("-inf")
    return logits


def _repeat_rows(rows: torch.Tensor, token_ids: list[torch.Tensor]) -> torch.Tensor:
    """Row index of each token in torch.cat(token_ids)."""
    return rows.repeat_interleave(torch.tensor([len(t) for t in token_ids]))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's top-k tokens, then the smallest set of those whose probability reaches top-p.

    k is [B] int64 with 0 meaning no top-k; p is [B] float32. One ascending sort serves both masks.
    Modifies logits in place and returns it.
    """
    if p is None:
        if k is None:
            return logits
        return apply_top_k_only(logits, k)

    vocab_size = logits.shape[-1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        k = _effective_k(k, vocab_size)
        # The k-th largest value sits at ascending index V - k; ties with it are kept.
        threshold = logits_sort.gather(1, (vocab_size - k).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < threshold, float("-inf"))

    # A token is dropped when it and everything less likely together hold at most 1 - p of the mass,
    # i.e. the tokens above it already reach p.
    probs_sum = logits_sort.softmax(dim=-1).cumsum_(dim=-1)
    top_p_mask = probs_sum <= 1 - p.unsqueeze(1)
    top_p_mask[:, -1] = False  # always keep the most likely token
    logits_sort.masked_fill_(top_p_mask, float("-inf"))
    return logits.scatter_(dim=-1, index=logits_idx, src=logits_sort)


def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Top-k without sorting the vocabulary: one topk up to the batch's largest k. In place."""
    vocab_size = logits.shape[-1]
    k = _effective_k(k, vocab_size)
    no_top_k = k == vocab_size
    # Rows without top-k gather a dummy column, then get a -inf threshold that drops nothing.
    k = k.masked_fill(no_top_k, 1)
    top_values = logits.topk(int(k.max()), dim=-1).values
    threshold = top_values.gather(1, (k - 1).unsqueeze(1))
    threshold.masked_fill_(no_top_k.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < threshold, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability. In place.

    Compared in log space (logit < max_logit + log(min_p)), so no softmax is needed; min_p 0 gives -inf
    and drops nothing. Masks that keep the top token do not change the ratio (top-k drops the same tokens either
    way), but top-p's cumulative mass is over what min-p left: Sampler.probs applies min-p first, as vLLM V1.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill_(logits < threshold, float("-inf"))


def _effective_k(k: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Map "no top-k" (0) and oversized k to the vocabulary size."""
    return k.masked_fill(k <= 0, vocab_size).clamp_(max=vocab_size).long()
