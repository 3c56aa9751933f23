"""LOSSY verification walks (opt-in): the rules of :mod:`.rules` applied to chains and trees.

Never used unless a request asks for ``verify="lossy:RULE:PARAM"``; the lossless core does not import this
package. Shapes as in core/verify.py: a chain has ``g`` draft tokens with ``p: [g + 1, V]``, ``q: [g, V]``.

In our words, with the worked examples the tests assert: docs/design.md §6.
"""

from __future__ import annotations

import torch

from ..core.sampling import SamplingParams, target_probs
from ..core.tree import Tree
from ..core.verify import Verdict, retry_walk
from ..errors import SpecgraftError
from .rules import Rule


def lossy_chain(draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor, rule: Rule,
                gen: torch.Generator) -> tuple[int, int]:
    """A LOSSY rule on a chain: accept ``x_i`` with ``rule.accept_prob(p_i, q_i)[x_i]``; at the first
    rejection emit from ``rule.fallback(p_i, q_i)``; if all are accepted the bonus comes from ``p_g``.
    Shapes as in :func:`~specgraft.core.verify.sample_chain`. Returns ``(n_accepted, next_token)``."""
    g = draft.shape[0]
    for i in range(g):
        pi, qi, x = p[i].double(), q[i].double(), int(draft[i])
        a = float(rule.accept_prob(pi, qi)[x])
        if float(torch.rand((), generator=gen, dtype=torch.float64)) >= a:
            return i, int(torch.multinomial(rule.fallback(pi, qi), 1, generator=gen))
    return g, int(torch.multinomial(p[g].double(), 1, generator=gen))


def lossy_tree(tree: Tree, probs: torch.Tensor, rule: Rule, gen: torch.Generator) -> Verdict:
    """A LOSSY rule on deterministic candidates (q = 1 convention): the sibling-retry walk of
    :func:`~specgraft.core.verify.retry_walk` with ``rule.tree_gate(p)`` in place of ``r[x]``. Sibling order matters here
    (drafted siblings by score, then retrieved ones by rank: the order the drafters emit)."""
    return retry_walk(tree, probs, rule.tree_gate, gen)


def verify_tree_lossy(tree: Tree, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator,
                      rule: Rule) -> Verdict:
    """A LOSSY ``rule`` in place of the lossless rule (sampling only): chains that carry ``q`` use the chain
    form, deterministic candidates the tree form."""
    if params.greedy:
        raise SpecgraftError("lossy verification rules need sampling (temperature > 0)")
    probs = target_probs(logits, params)
    if tree.draft_probs is not None and tree.size > 1:
        n_acc, nxt = lossy_chain(tree.tokens[1:], probs, tree.draft_probs[1:], rule, gen)
        return Verdict(list(range(n_acc + 1)), nxt)
    return lossy_tree(tree, probs, rule, gen)
