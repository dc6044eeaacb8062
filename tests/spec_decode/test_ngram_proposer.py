"""NgramProposer: the longest matching n-gram's earliest occurrence proposes what followed it, per row of a batch."""
import numpy as np

from pagedllm.spec_decode.ngram_proposer import NgramProposer


def propose(rows: list[list[int]], k: int = 3, min_n: int = 1, max_n: int = 3, max_model_len: int = 100):
    width = max(len(r) for r in rows) + 4
    table = np.full((len(rows), width), 7777, dtype=np.int64)  # garbage past each row's tokens
    for i, r in enumerate(rows):
        table[i, :len(r)] = r
    return NgramProposer(min_n, max_n, k, max_model_len).propose(table, np.array([len(r) for r in rows]))


def test_the_tokens_after_the_earliest_occurrence_of_the_suffix():
    assert propose([[1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2, 3]]) == [[4, 5, 1]]


def test_the_longest_n_gram_wins_over_a_shorter_earlier_one():
    # "3" alone first occurs at index 0 (followed by 8); "2 3" first at index 4 (followed by 6).
    assert propose([[3, 8, 0, 0, 2, 3, 6, 2, 3]], k=1, max_n=2) == [[6]]


def test_no_match_no_draft_and_the_suffix_never_matches_itself():
    assert propose([[1, 2, 3, 4], [5]]) == [[], []]


def test_drafts_stop_at_the_known_tokens_at_k_and_before_max_model_len():
    assert propose([[1, 2, 1]], k=5) == [[2, 1]]  # only two tokens follow the earlier "1"
    assert propose([[4, 5, 6, 7, 8, 4]], k=2) == [[5, 6]]
    assert propose([[4, 5, 6, 7, 8, 4]], k=5, max_model_len=9) == [[5, 6]]  # 6 known + 2 drafts + bonus = 9


def test_rows_of_different_lengths_in_one_batch_with_min_n():
    rows = [[1, 2, 3, 1, 2], [9, 9, 9, 9], [5, 6, 7, 8, 6]]
    # min_n=2: row 2's suffix "8 6" never occurred before and "6" alone is too short.
    assert propose(rows, k=2, min_n=2) == [[3, 1], [9], []]
    assert propose(rows, k=2, min_n=1) == [[3, 1], [9], [7, 8]]
