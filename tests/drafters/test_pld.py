import numpy as np

from specgraft.core.drafter import DraftContext
from specgraft.drafters.pld import PromptLookup, pld_candidates


def test_docstring_example_and_longest_ngram_first():
    a, b, c, d, e, f = range(1, 7)
    ids = np.array([a, b, c, d, e, f, a, b, c])
    assert pld_candidates(ids, 3, 4) == [d, e, f, a]
    # the 3-gram "x b c" has no earlier match, the 2-gram "b c" does (earliest first)
    ids = np.array([9, b, c, d, 8, b, c, e, 7, b, c])
    assert pld_candidates(ids, 3, 2) == [d, 8]


def test_truncated_continuation_and_no_match():
    ids = np.array([5, 6, 5])
    assert pld_candidates(ids, 3, 10) == [6, 5]
    assert pld_candidates(np.array([1, 2, 3, 4]), 3, 10) == []
    assert pld_candidates(np.array([1]), 3, 10) == []


def test_drafter_respects_budget():
    ids = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    tree = PromptLookup(3).propose(DraftContext(ids, budget=3))
    assert tree.tokens.tolist() == [2, 3, 4, 5]
    assert PromptLookup(3).propose(DraftContext(ids, budget=0)).size == 1
