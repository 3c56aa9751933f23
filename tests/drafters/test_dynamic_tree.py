"""Golden outputs of the worked examples in docs/design.md §4.4."""

import math

import pytest
import torch

from specgraft.drafters.dynamic_tree import Pool, expand_topk, expand_topk_steps, rerank
from specgraft.core.tree import Tree

A, B = 0, 1  # level-0 tokens; children use tokens 2/3 (level 1) and 0/1 (level 2)


def logp(probs: dict, v: int = 4) -> torch.Tensor:
    x = torch.full((v,), 1e-6)
    for t, p in probs.items():
        x[t] = p
    return x.log()


def golden_candidates(keep=None):
    table = {(A,): {2: 0.5, 3: 0.3}, (B,): {2: 0.7, 3: 0.2}, (A, 2): {0: 0.9, 1: 0.05}, (B, 2): {0: 0.5, 1: 0.4}}
    paths: dict[int, tuple] = {}

    def path(c, cands_tokens, cands_parents):
        out = []
        while c != -1:
            out.append(cands_tokens[c])
            c = cands_parents[c]
        return tuple(reversed(out))

    state = {"tokens": [A, B], "parents": [-1, -1]}

    def expand(frontier):
        rows = [logp(table[path(f, state["tokens"], state["parents"])]) for f in frontier]
        # mirror what expand_topk appends, so paths of the next frontier can be resolved
        for f, r in zip(frontier, rows):
            top = torch.topk(r, 2).indices.tolist()
            state["tokens"].extend(top)
            state["parents"].extend([f, f])
        return torch.stack(rows)

    return expand_topk(logp({A: 0.6, B: 0.35}), expand, top_k=2, depth=2, keep=keep)


def test_eagle_rerank_golden():
    c = golden_candidates()
    assert len(c.tokens) == 2 + 2 * 2 * 2  # k + D*k^2
    cum = [math.exp(s) for s in c.scores]
    expected = [0.6, 0.35, 0.30, 0.18, 0.245, 0.07, 0.27, 0.015, 0.1225, 0.098]
    assert all(abs(a - b) < 1e-4 for a, b in zip(cum, expected)), cum
    assert [round(x, 4) for x in c.level_best] == [0.6, 0.3, 0.27]
    tokens, parents, kept = rerank(c, 5)
    assert kept == [0, 1, 2, 4, 6]
    assert [-1] + parents == [-1, 0, 0, 1, 2, 3]
    assert tokens == [A, B, 2, 2, 0]
    Tree.build([9] + tokens, [-1] + parents)  # a valid tree
    tokens6, parents6, kept6 = rerank(c, 6)
    assert kept6 == [0, 1, 2, 3, 4, 6]  # adds ab


def test_rerank_is_prefix_closed_for_every_budget():
    c = golden_candidates()
    for n in range(1, len(c.tokens) + 1):
        tokens, parents, _ = rerank(c, n)
        assert len(tokens) == n
        assert all(p < i + 1 for i, p in enumerate(parents))


def path_model(seed: int, vocab: int = 12):
    """``expand`` for :func:`expand_topk` whose next-token log-probs depend only on the node's path (drawn from a
    generator seeded by it), so two expansions agree on every node they share. Counts the rows expanded."""
    state = {"tokens": [], "parents": [], "rows": 0}

    def path(c):
        out = []
        while c != -1:
            out.append(state["tokens"][c])
            c = state["parents"][c]
        return tuple(reversed(out))

    def row(key: tuple) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((seed, key)) % 2**31)
        return torch.log_softmax(3 * torch.randn(vocab, generator=g), -1)

    def expand(frontier, top_k):
        rows = torch.stack([row(path(f)) for f in frontier])
        for f, r in zip(frontier, rows):  # mirror what expand_topk appends
            state["tokens"].extend(torch.topk(r, top_k).indices.tolist())
            state["parents"].extend([f] * top_k)
        state["rows"] += len(frontier)
        return rows

    def first(top_k):
        r = row(())
        state["tokens"][:] = torch.topk(r, top_k).indices.tolist()
        state["parents"][:] = [-1] * top_k
        state["rows"] = 0
        return r

    return first, expand, state


def test_expanding_only_what_the_rerank_can_keep_gives_the_same_tree_for_fewer_rows():
    """docs/design.md §4.4: with ``keep``, a node is expanded only while fewer than ``keep`` generated nodes
    score at least as high (so at most ``keep - d - 1`` nodes of level ``d``), and the best ``keep`` candidates
    (tokens, parents, order) are those of the full expansion, on 300 random models."""
    saved = 0
    for trial in range(300):
        top_k, depth, keep = 1 + trial % 5, trial % 7, 1 + (trial * 7) % 13
        first, expand, state = path_model(trial)
        full = expand_topk(first(top_k), lambda f: expand(f, top_k), top_k, depth)
        full_rows = state["rows"]
        capped = expand_topk(first(top_k), lambda f: expand(f, top_k), top_k, depth, keep=keep)
        assert rerank(capped, keep)[:2] == rerank(full, keep)[:2], (trial, top_k, depth, keep)
        per_level_bound = sum(min(top_k, keep - d - 1) for d in range(min(depth, keep - 1)))
        assert state["rows"] <= per_level_bound <= full_rows
        saved += per_level_bound - state["rows"]
    assert saved > 0  # the count sees better nodes at other levels, not only the node's own level


def test_the_count_rule_at_eagles_default_shape_and_the_worked_example():
    first, expand, state = path_model(0, vocab=40)
    full = expand_topk(first(10), lambda f: expand(f, 10), 10, 7)
    capped = expand_topk(first(10), lambda f: expand(f, 10), 10, 7, keep=7)
    assert rerank(capped, 7)[:2] == rerank(full, 7)[:2]
    assert state["rows"] <= 6 + 5 + 4 + 3 + 2 + 1  # instead of 7 levels x 10
    # the worked example keeping 3: a and b are expanded; aa (.30) already has a, b and itself at least as
    # high, so its children (rank >= 4) cannot be kept and level 1 expands nothing: 6 candidates
    c = golden_candidates(keep=3)
    assert len(c.tokens) == 2 + 4
    assert rerank(c, 3)[:2] == rerank(golden_candidates(), 3)[:2] == ([A, B, 2], [0, 0, 1])
    # keeping 4, aa (3 at least as high) is expanded and ba (.245: a, b, aa, ba) is not
    c4 = golden_candidates(keep=4)
    assert len(c4.tokens) == 2 + 4 + 2 and c4.parents[6:] == [2, 2]
    assert rerank(c4, 4)[:2] == rerank(golden_candidates(), 4)[:2]
    with pytest.raises(ValueError, match="keep"):
        expand_topk(first(2), lambda f: expand(f, 2), 2, 2, gate=lambda *a: False, keep=3)


def test_the_pool_is_filled_as_candidates_are_generated():
    """A drafter reads the frontier's tokens and parents from the pool between steps."""
    first, expand, state = path_model(3)
    pool = Pool()
    steps = expand_topk_steps(first(3), 3, 2, pool=pool)
    frontier = steps.send(None)
    assert pool.tokens == state["tokens"] and pool.parents == [-1] * 3 and frontier == [0, 1, 2]
    frontier = steps.send(expand(frontier, 3))
    assert pool.tokens == state["tokens"] and len(pool.tokens) == 3 + 9
    assert all(pool.levels[c] == 1 for c in frontier)
    with pytest.raises(StopIteration) as stop:
        steps.send(expand(frontier, 3))
    assert stop.value.value.tokens is pool.tokens and len(pool.tokens) == 3 + 9 + 9
    with pytest.raises(ValueError, match="empty"):
        next(expand_topk_steps(first(3), 3, 2, pool=pool))
