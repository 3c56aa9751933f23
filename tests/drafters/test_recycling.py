"""Golden outputs of the worked examples in docs/design.md §4.2."""

import numpy as np
import torch

from specgraft.core.drafter import DraftContext
from specgraft.drafters.matrix import AdjacencyMatrix, compile_template
from specgraft.drafters.recycling import TEMPLATE_222, TokenRecycling
from specgraft.core.tree import SOURCE_RETRIEVAL


def test_template_222_golden():
    parents, ranks, depths = compile_template(TEMPLATE_222)
    assert len(TEMPLATE_222) == 80
    assert np.bincount(depths)[1:].tolist() == [8, 21, 25, 15, 8, 3]
    assert (ranks[1:] < 8).all()
    assert all(parents[i] < i for i in range(1, len(parents)))  # prefix-closed, BFS order


def full_matrix(vocab=20, k=8, seed=0) -> AdjacencyMatrix:
    m = AdjacencyMatrix(vocab, k)
    g = torch.Generator().manual_seed(seed)
    m.table = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(vocab)])
    return m


def test_materialize_full_matrix_every_node_is_its_parents_successor():
    m = full_matrix()
    parents, ranks, depths = compile_template(TEMPLATE_222)
    tree = m.materialize(3, parents, ranks, depths)
    assert tree.size == 81
    toks = tree.tokens.tolist()
    for i in range(1, 81):
        assert toks[i] == int(m.table[toks[tree.parent_list[i]], ranks[i]])
    assert (tree.source[1:] == SOURCE_RETRIEVAL).all()


def test_cold_root_gives_root_only_and_cold_row_drops_subtree():
    m = AdjacencyMatrix(20, 8)
    parents, ranks, depths = compile_template(((0,), (1,), (0, 0), (1, 0), (0, 0, 0)))
    assert m.materialize(3, parents, ranks, depths).size == 1
    m.table[3] = torch.arange(8) + 10  # root row: 10, 11, ...
    m.table[11] = torch.arange(8)  # only rank-1 child's row is filled
    tree = m.materialize(3, parents, ranks, depths)
    # [0] -> 10 (row 10 cold: [0,0] and [0,0,0] dropped), [1] -> 11, [1,0] -> M[11,0] = 0
    assert tree.tokens.tolist() == [3, 10, 11, 0]
    assert tree.parents.tolist() == [-1, 0, 0, 2]


def test_update_last_occurrence_wins_and_other_rows_unchanged():
    m = AdjacencyMatrix(10, 3)
    before = m.table.clone()
    tokens = torch.tensor([4, 7, 4])
    logits = torch.tensor([[9.0, 8, 7, 0, 0, 0, 0, 0, 0, 0],
                           [0, 0, 0, 9, 8, 7, 0, 0, 0, 0],
                           [0, 0, 0, 0, 0, 0, 9, 8, 7, 0]])
    m.update(tokens, logits)
    assert m.table[4].tolist() == [6, 7, 8]  # last occurrence of token 4
    assert m.table[7].tolist() == [3, 4, 5]
    others = [i for i in range(10) if i not in (4, 7)]
    assert torch.equal(m.table[others], before[others])


def test_cold_vs_hot_scope_and_budget():
    logits = torch.randn(5, 30)
    for scope, expect_rows in (("cold", 3), ("hot", 5)):
        tr = TokenRecycling(30, k=4, scope=scope)
        tr.start([1, 2, 3], logits[:3])
        tr.start([4, 5], logits[3:])
        assert tr.matrix.rows_filled == (2 if scope == "cold" else 5)
        tree = tr.propose(DraftContext([4, 5], budget=6))
        assert tree.size - 1 <= 6
    assert tr.describe()["retrieval_state"] == "hot"


def test_prefill_logits_only_at_last_occurrences_give_the_same_matrix():
    """The engine asks the prefill for logits at each distinct prompt token's last occurrence only (an lm_head
    over every position of a long prompt is a large part of the prefill); the matrix is the same as from all."""
    from specgraft.core.backend import TargetBackend
    from specgraft.core.drafter import last_occurrences

    from ..conftest import tiny_llama

    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    assert last_occurrences(ids) == [2, 3, 5, 6, 7, 9, 10]  # 4, 1, 9, 2, 6, 3, 5
    backend = TargetBackend(tiny_llama(vocab=16))
    full = backend.prefill(torch.tensor(ids), True).logits
    rows = torch.tensor(last_occurrences(ids))
    part = backend.prefill(torch.tensor(ids), rows).logits
    assert part.shape[0] == len(rows) and torch.allclose(part, full[rows], atol=1e-5)
    a, b = AdjacencyMatrix(16, 4), AdjacencyMatrix(16, 4)
    a.update(torch.tensor(ids), full)
    b.update_prompt(ids, part)
    assert torch.equal(a.table, b.table) and a.rows_filled == len(set(ids))
