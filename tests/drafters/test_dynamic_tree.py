"""Golden outputs of the worked examples in docs/design.md §4.4."""

import math

import torch

from specgraft.drafters.dynamic_tree import expand_topk, rerank
from specgraft.core.tree import Tree

A, B = 0, 1  # level-0 tokens; children use tokens 2/3 (level 1) and 0/1 (level 2)


def logp(probs: dict, v: int = 4) -> torch.Tensor:
    x = torch.full((v,), 1e-6)
    for t, p in probs.items():
        x[t] = p
    return x.log()


def golden_candidates():
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

    return expand_topk(logp({A: 0.6, B: 0.35}), expand, top_k=2, depth=2)


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
