"""Verification rules: greedy goldens, and statistical losslessness tests that can fail.

The "model" here is a random table ``p(. | prefix)`` over a small vocabulary, so the exact AR
distribution of the first three tokens is known. Each rule commits some tokens from one verified step; the
rest of the three are filled by plain AR sampling, so any bias of the rule shows up in the joint.

In our words, with the worked examples the tests assert: docs/design.md §3.
"""

import itertools

import numpy as np
import pytest
import torch

from specgraft.core.tree import Tree
from specgraft.core.verify import greedy_tree, sample_chain, sample_tree, sample_tree_retry, walk

from ..stattest import assert_matches

V = 5
N_DRAWS = 30_000
# power >= 0.95 against a sibling retry that does not renormalise (scripts/sampling_power.py)
ACCEPT_LENGTH_DRAWS = 60_000


class TableModel:
    """Random conditional distributions p(. | prefix) (and draft q(. | prefix)) for prefixes up to length 3."""

    def __init__(self, seed: int, alpha: float = 0.6):
        rng = np.random.default_rng(seed)
        self.p, self.q = {}, {}
        for n in range(4):
            for prefix in itertools.product(range(V), repeat=n):
                self.p[prefix] = torch.tensor(rng.dirichlet([alpha] * V), dtype=torch.float64)
                self.q[prefix] = torch.tensor(rng.dirichlet([alpha] * V), dtype=torch.float64)

    def ar_joint(self) -> dict:
        return {seq: float(self.p[()][seq[0]] * self.p[seq[:1]][seq[1]] * self.p[seq[:2]][seq[2]])
                for seq in itertools.product(range(V), repeat=3)}

    def complete(self, prefix: tuple, gen: torch.Generator) -> tuple:
        while len(prefix) < 3:
            prefix += (int(torch.multinomial(self.p[prefix], 1, generator=gen)),)
        return prefix[:3]

    def tree_probs(self, tree: Tree) -> torch.Tensor:
        toks = tree.tokens.tolist()
        rows = []
        for i in range(tree.size):
            path = []
            node = i
            while node != 0:
                path.append(toks[node])
                node = tree.parent_list[node]
            rows.append(self.p[tuple(reversed(path))])
        return torch.stack(rows)


def dup_tree() -> Tree:
    """Root children [1, 1, 3] (a duplicate sibling), grandchildren with duplicates, depth 3."""
    tokens = [0, 1, 1, 3, 2, 2, 0, 4, 4, 1]
    parents = [-1, 0, 0, 0, 1, 1, 1, 3, 4, 4]
    return Tree.build(tokens, parents)


def random_tree(rng: np.random.Generator, w: int) -> Tree:
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, w)]
    tokens = [0] + [int(t) for t in rng.integers(0, V, size=w - 1)]
    return Tree.build(tokens, parents)


def run_tree_rule(rule, model: TableModel, tree: Tree, n: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    probs = model.tree_probs(tree)
    toks = tree.tokens.tolist()
    counts: dict = {}
    for _ in range(n):
        v = rule(tree, probs, gen)
        committed = tuple(toks[i] for i in v.accepted[1:]) + (v.bonus,)
        seq = model.complete(committed, gen)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def broken_retry(tree, probs, gen):
    """sibling-retry without the residual: the bonus comes from p itself (over-weights rejected tokens)."""
    toks = tree.tokens.tolist()
    node, accepted = 0, [0]
    while True:
        r = probs[node]
        nxt = None
        for c in tree.children[node]:
            if torch.rand((), generator=gen, dtype=torch.float64) < r[toks[c]]:
                nxt = c
                break
        if nxt is None:
            return type(walk(tree, [0] * tree.size))(accepted, int(torch.multinomial(r, 1, generator=gen)))
        node = nxt
        accepted.append(node)


@pytest.mark.parametrize("rule", [sample_tree, sample_tree_retry], ids=["sample-then-match", "sibling-retry"])
def test_tree_sampling_reproduces_ar_joint(rule):
    model = TableModel(seed=1)
    assert_matches(run_tree_rule(rule, model, dup_tree(), N_DRAWS, seed=2), model.ar_joint(), N_DRAWS,
                   rule.__name__)


def test_tree_sampling_random_trees():
    rng = np.random.default_rng(5)
    model = TableModel(seed=3)
    for k in range(3):
        tree = random_tree(rng, w=int(rng.integers(4, 12)))
        assert_matches(run_tree_rule(sample_tree, model, tree, 15_000, seed=10 + k), model.ar_joint(), 15_000,
                       f"random tree {k}")


def test_broken_residual_is_detected():
    """The statistical check has power: dropping the residual step must fail it."""
    model = TableModel(seed=1)
    with pytest.raises(AssertionError):
        assert_matches(run_tree_rule(broken_retry, model, dup_tree(), N_DRAWS, seed=2), model.ar_joint(), N_DRAWS)


def exact_accept_lengths(model: TableModel, tree: Tree) -> dict:
    """P(a = d): the walk reaches node v with probability A(v) (first of duplicate siblings only)."""
    toks = tree.tokens.tolist()
    probs = model.tree_probs(tree)
    out: dict = {}

    def visit(node: int, reach: float, depth: int) -> None:
        seen, leave = set(), 1.0
        for c in tree.children[node]:
            if toks[c] in seen:
                continue
            seen.add(toks[c])
            pc = float(probs[node][toks[c]])
            leave -= pc
            visit(c, reach * pc, depth + 1)
        out[depth] = out.get(depth, 0.0) + reach * leave

    visit(0, 1.0, 0)
    return out


def test_both_tree_forms_have_the_exact_accept_length_distribution():
    model, tree = TableModel(seed=4), dup_tree()
    exact = exact_accept_lengths(model, tree)
    probs = model.tree_probs(tree)
    for rule in (sample_tree, sample_tree_retry):
        gen = torch.Generator().manual_seed(7)
        counts: dict = {}
        n = ACCEPT_LENGTH_DRAWS
        for _ in range(n):
            a = rule(tree, probs, gen).accept_length
            counts[a] = counts.get(a, 0) + 1
        assert_matches(counts, exact, n, rule.__name__)


def run_chain(model: TableModel, g: int, n: int, seed: int, residual: bool = True) -> dict:
    gen = torch.Generator().manual_seed(seed)
    counts: dict = {}
    for _ in range(n):
        prefix: tuple = ()
        draft, qs = [], []
        for _ in range(g):
            q = model.q[prefix]
            x = int(torch.multinomial(q, 1, generator=gen))
            draft.append(x)
            qs.append(q)
            prefix += (x,)
        p = torch.stack([model.p[tuple(draft[:i])] for i in range(g + 1)])
        q = torch.stack(qs)
        if residual:
            n_acc, nxt = sample_chain(torch.tensor(draft), p, q, gen)
        else:  # broken: correction drawn from p instead of (p - q)+
            n_acc, _ = sample_chain(torch.tensor(draft), p, q, gen)
            nxt = int(torch.multinomial(p[n_acc], 1, generator=gen))
        seq = model.complete(tuple(draft[:n_acc]) + (nxt,), gen)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def test_chain_sampling_reproduces_ar_joint():
    model = TableModel(seed=6)
    assert_matches(run_chain(model, 2, N_DRAWS, seed=8), model.ar_joint(), N_DRAWS, "chain")


def test_chain_without_residual_is_detected():
    model = TableModel(seed=6)
    with pytest.raises(AssertionError):
        assert_matches(run_chain(model, 2, N_DRAWS, seed=8, residual=False), model.ar_joint(), N_DRAWS)


def test_chain_edge_cases():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert sample_chain(torch.tensor([1]), p, torch.tensor([[0.0, 1.0, 0.0]]), gen) == (1, 0)
    # q puts all mass on a token p rejects: always rejected, correction from (p - q)+ = token 1.
    assert sample_chain(torch.tensor([2]), p, torch.tensor([[0.0, 0.0, 1.0]]), gen) == (0, 1)


def test_greedy_tree_walk_golden():
    # root 7; children [5, 9]; 9 -> [3, 3]; 3 -> [8]
    tree = Tree.build([7, 5, 9, 3, 3, 8], [-1, 0, 0, 2, 2, 3])
    logits = torch.full((6, 10), -1.0)
    for node, best in enumerate([9, 0, 3, 8, 1, 4]):
        logits[node, best] = 1.0
    v = greedy_tree(tree, logits)
    assert v.accepted == [0, 2, 3, 5] and v.bonus == 4 and v.accept_length == 3
    logits[0] = 0
    logits[0, 6] = 1.0  # no child matches: only the bonus
    v = greedy_tree(tree, logits)
    assert v.accepted == [0] and v.bonus == 6
