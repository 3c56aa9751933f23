"""Lossless verification rules, each a small pure function.

Vocabulary (as in vLLM's rejection sampler):

- **accepted** nodes: candidate nodes (drafted or retrieved) whose tokens the target agrees with; they
  form one root-to-node path. The accepted length ``a`` excludes the root.
- **bonus** token: the one extra token every step commits, drawn from the target at the last accepted
  node. After a rejection it is the *recovered* (correction) token, drawn from the residual distribution.
- **committed** tokens of a step: ``tokens[accepted[1:]] + [bonus]``, i.e. ``a + 1`` tokens; MAT counts them.

Shapes: a tree has ``W`` nodes; ``logits``/``probs`` are ``[W, V]`` (row i = target at node i); a chain has
``g`` draft tokens with ``p: [g + 1, V]`` and ``q: [g, V]``.

Candidates of trees are deterministic (fixed before any target randomness), so tree sampling uses the
"q = 1" rule: accept sibling ``x`` with probability ``r(x)``, on rejection zero it and renormalise. The
production form draws one sample per node and walks (sample-then-match), which is equal in distribution.

In our words, with the worked examples the tests assert: docs/design.md §3.2-§3.8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .sampling import SamplingParams, target_probs
from .tree import Tree


Gate = Callable[[int, torch.Tensor], float]  # (token, current residual r) -> acceptance probability


@dataclass(frozen=True)
class Verdict:
    accepted: list[int]  # node indices on the accepted path, root (0) first
    bonus: int  # token id appended after the accepted path

    @property
    def accept_length(self) -> int:
        return len(self.accepted) - 1


def walk(tree: Tree, y: list[int]) -> Verdict:
    """Follow, from the root, the first child whose token equals the target's choice ``y[node]``.

    Taking the *first* matching child makes duplicate siblings harmless (the second is never used).
    """
    tokens = tree.tokens.tolist()
    node, accepted = 0, [0]
    kids = tree.children
    while True:
        want = y[node]
        nxt = next((c for c in kids[node] if tokens[c] == want), None)
        if nxt is None:
            return Verdict(accepted, want)
        node = nxt
        accepted.append(node)


def greedy_tree(tree: Tree, logits: torch.Tensor) -> Verdict:
    """Longest path that agrees with the target argmax; the bonus is the argmax where it stops."""
    return walk(tree, logits.argmax(-1).tolist())


def sample_tree(tree: Tree, probs: torch.Tensor, gen: torch.Generator) -> Verdict:
    """Sample-then-match: draw ``y_i ~ p_i`` for every node, walk the matches, bonus = ``y`` at the end.

    Equal in distribution to :func:`sample_tree_retry`: sibling ``x`` is entered with probability
    ``p(x)``, and otherwise the bonus is ``p`` restricted to the non-candidate tokens (the residual).
    """
    y = torch.multinomial(probs.float(), 1, generator=gen).squeeze(-1)
    return walk(tree, y.tolist())


def sample_tree_retry(tree: Tree, probs: torch.Tensor, gen: torch.Generator) -> Verdict:
    """Reference sibling-retry form (EAGLE ``evaluate_posterior``); one uniform per tried sibling.

    For each child in sibling order: accept with ``r[x]`` (q = 1); on rejection set ``r[x] = 0`` and
    renormalise (the residual of a one-hot proposal). Duplicate siblings are skipped. If no child is
    accepted, the bonus is drawn from the residual ``r``.
    """
    return retry_walk(tree, probs, lossless_gate, gen)


def sample_chain(
    draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor, gen: torch.Generator
) -> tuple[int, int]:
    """Chain speculative sampling (Leviathan et al.) with draft probabilities.

    ``draft: [g]`` tokens sampled from ``q: [g, V]``; ``p: [g + 1, V]`` from one target forward.
    Accept ``x_i`` with ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection emit a token from
    ``norm(max(0, p_i - q_i))``; if all are accepted emit the bonus from ``p_g``.
    Returns ``(n_accepted, next_token)``.
    """
    g = draft.shape[0]
    idx = torch.arange(g)
    p64, q64 = p.double(), q.double()
    ratio = (p64[idx, draft] / q64[idx, draft]).clamp(max=1.0)  # ratios in float64
    reject = torch.rand(g, generator=gen, dtype=torch.float64) > ratio
    n_acc = int(reject.int().argmax()) if bool(reject.any()) else g
    if n_acc == g:
        return g, int(torch.multinomial(p64[g], 1, generator=gen))
    residual = (p64[n_acc] - q64[n_acc]).clamp(min=0.0)
    if residual.sum() <= 0:  # only when p == q, where rejection has probability 0; guard anyway
        residual = p64[n_acc]
    return n_acc, int(torch.multinomial(residual, 1, generator=gen))


def retry_walk(tree: Tree, probs: torch.Tensor, gate_of: Callable[[torch.Tensor], Gate],
               gen: torch.Generator) -> Verdict:
    """The sibling-retry walk over deterministic candidates (q = 1 convention): at each node, try the
    children in sibling order, enter child ``x`` with probability ``gate(x, r)``, on rejection set
    ``r[x] = 0`` and renormalise; the bonus is drawn from the final ``r``. Duplicate siblings are skipped.
    ``gate_of(p)`` builds the gate from the node's target distribution: ``r[x]`` is the lossless one; the
    LOSSY rules of the lossy package pass their own (docs/design.md §3)."""
    tokens = tree.tokens.tolist()
    node, accepted = 0, [0]
    while True:
        p = probs[node].double()
        if not tree.children[node]:  # a leaf (or a lone root): the bonus comes from the target, no gate needed
            return Verdict(accepted, int(torch.multinomial(p, 1, generator=gen)))
        gate = gate_of(p)
        r = p.clone()
        tried: set[int] = set()
        moved = False
        for c in tree.children[node]:
            x = tokens[c]
            if x in tried:
                continue
            tried.add(x)
            if float(torch.rand((), generator=gen, dtype=torch.float64)) < gate(x, r):
                node, moved = c, True
                accepted.append(c)
                break
            r[x] = 0.0
            total = r.sum()
            if total <= 0:  # every token of p was tried and rejected: stop with the target itself
                r = p
                break
            r = r / total
        if not moved:
            return Verdict(accepted, int(torch.multinomial(r, 1, generator=gen)))


def lossless_gate(p: torch.Tensor) -> Gate:
    """Accept sibling ``x`` with the current residual ``r[x]`` (exact for one-hot proposals)."""
    return lambda x, r: float(r[x])


def verify_tree(tree: Tree, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> Verdict:
    """The lossless rule for the tree under the given sampling settings: greedy matching; chain speculative
    sampling (``p/q``) for chains that carry the draft distribution they were sampled from; otherwise the
    q = 1 rule for deterministic candidates (sample-then-match)."""
    if params.greedy:
        return greedy_tree(tree, logits)
    probs = target_probs(logits, params)
    if tree.draft_probs is not None and tree.size > 1:
        n_acc, nxt = sample_chain(tree.tokens[1:], probs, tree.draft_probs[1:], gen)
        return Verdict(list(range(n_acc + 1)), nxt)
    return sample_tree(tree, probs, gen)
