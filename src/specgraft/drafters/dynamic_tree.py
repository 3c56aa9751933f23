"""EAGLE-2/3 dynamic draft trees (``topK_genrate``): beam expansion by cumulative log-probability, then a
global rerank that keeps the best ``budget`` candidates.

Worked example (the golden test; ``top_k = 2``, ``depth = 2``, ``budget = 5``)::

    level 0:  a 0.6   b 0.35                          frontier {a, b}
    level 1:  aa .30  ab .18  ba .245  bb .07         frontier {aa, ba}   (cumulative probabilities)
    level 2:  aaa .27 aab .015 baa .1225 bab .098
    pool (k + D*k^2 = 10), top 5 by score: a .6, b .35, aa .30, aaa .27, ba .245
    back in generation order: a, b, aa, ba, aaa  ->  parents [-1, 0, 0, 1, 2, 3]  (index 0 = root)

A child's cumulative log-probability never exceeds its parent's, so the selection is prefix-closed; ties
are broken by generation order, which puts parents first.

The model is abstracted as ``expand(frontier) -> logp``: given candidate indices of the frontier, return
their next-token log-probabilities ``[len(frontier), V]``. The head drafter and the draft-model drafter
each implement it with their own forward pass.

A *gate* (a pruning policy, :mod:`specgraft.graft.pruning`) may stop the expansion after any level: it sees the
level, the frontier's cumulative log-probs and the log-prob row that produced the best frontier node; on
``True`` no further draft forward runs and ``Candidates.stopped_at`` records the level.

*Only what the rerank can keep* (``keep``): a caller that keeps the best ``keep`` candidates need not expand
the rest. A kept node at level ``d`` brings its ``d`` ancestors, and every node of its level that outscores
it is kept too (their scores are higher than its own), so the parent of a kept level-``d + 1`` node ranks
within the best ``keep - d - 1`` of level ``d``. The capped run may expand a node the full run does not (a
child of a node the full run left out); such a node has ``top_k`` better nodes at its level, so it is not kept,
and neither is anything below it (their scores are no higher), so it displaces no kept node. Capping each
level's frontier at ``min(top_k, keep - d - 1)`` (and so the depth at ``keep - 1``) therefore yields the same
kept candidates, in the same order, up to ties (and up to rounding: the head sees other matrix shapes):
at budget 7 and ``top_k`` 10, 21 rows through the head instead of 70. Not with a gate or with anything that
reads ``level_best`` (Graft's checkpoints, calibration): their inputs are the full frontier's.

In our words, with the worked examples the tests assert: docs/design.md §4.4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator, Literal, Protocol

import torch

from ..core.drafter import DraftContext, Drafter
from ..core.tree import SOURCE_DRAFT, Tree


@dataclass(frozen=True)
class Candidates:
    tokens: list[int]
    parents: list[int]  # candidate index, -1 = the root
    scores: list[float]  # cumulative log-probabilities
    level_best: list[float]  # best cumulative probability per level (checkpoint confidences c_l)
    stopped_at: int | None = None  # the level at which a gate stopped the expansion
    levels: list[int] | None = None  # level of each candidate (0 = the root's children)


Gate = Callable[[int, torch.Tensor, torch.Tensor], bool]  # (level, frontier scores [f], best's logp row [V])


class TreeDrafter(Drafter, Protocol):
    """An inner drafter Graft and the pruning baselines build on: it drafts a dynamic tree level by level,
    and a gate may stop it after any level (EAGLE-3 head, draft-model tree)."""

    shape: Literal["tree"]

    def draft(self, ctx: DraftContext, gate: Gate | None = None) -> Candidates | None: ...


class ChainDrafter(Drafter, Protocol):
    """An inner drafter that drafts one chain (draft-model chain; Graft-TAIL builds on it)."""

    shape: Literal["chain"]

    def chain(self, ctx: DraftContext, gamma: int, tau: float | None = None
              ) -> tuple[list[int], torch.Tensor | None, list[float]]:
        """Up to ``gamma`` tokens, their ``q`` rows (sampling) and stop statistics; ``tau`` stops early."""
        ...


InnerDrafter = TreeDrafter | ChainDrafter


def expand_topk(first_logp: torch.Tensor, expand: Callable[[list[int]], torch.Tensor], top_k: int,
                depth: int, gate: Gate | None = None, keep: int | None = None) -> Candidates:
    """Level 0 from ``first_logp`` ``[V]``, then up to ``depth`` expansions of the best ``top_k`` frontier
    (capped by ``keep``: see the module docstring)."""
    steps = expand_topk_steps(first_logp, top_k, depth, gate, keep)
    logp = None
    while True:
        try:
            frontier = steps.send(logp)  # (a StopIteration must not escape: callers may be generators)
        except StopIteration as stop:
            return stop.value
        logp = expand(frontier)


def expand_topk_steps(first_logp: torch.Tensor, top_k: int, depth: int, gate: Gate | None = None,
                      keep: int | None = None) -> Generator[list[int], torch.Tensor, Candidates]:
    """:func:`expand_topk` as steps: yields each frontier (candidate indices), is sent its log-probabilities
    ``[len(frontier), V]``, returns the candidates. A batched drafter runs many requests' steps in lockstep.
    ``keep``: the caller keeps only the best ``keep`` candidates, so frontiers are capped (module docstring)."""
    if keep is not None and gate is not None:
        raise ValueError("expand_topk: keep caps the frontiers a gate reads; use one or the other")

    def width(level: int) -> int:  # how many of a level's best nodes are expanded
        return top_k if keep is None else max(0, min(top_k, keep - level - 1))

    vals, ids = torch.topk(first_logp.float(), top_k)
    tokens, parents, scores = ids.tolist(), [-1] * top_k, vals.tolist()
    levels = [0] * top_k
    frontier = list(range(width(0)))
    level_best = [float(vals[0].exp())]
    if gate is not None and gate(0, vals, first_logp):
        return Candidates(tokens, parents, scores, level_best, 0, levels)
    for level in range(1, depth + 1):
        if not frontier:
            break
        logp = (yield frontier).float()
        cv, ci = torch.topk(logp, top_k, dim=-1)  # [f, k]
        cum = cv + torch.tensor([scores[f] for f in frontier]).unsqueeze(1)
        start = len(tokens)
        for row, f in enumerate(frontier):
            tokens.extend(ci[row].tolist())
            parents.extend([f] * top_k)
            scores.extend(cum[row].tolist())
        levels.extend([level] * cum.numel())
        top = torch.topk(cum.flatten(), min(top_k, cum.numel()))
        frontier = [start + b for b in top.indices.tolist()[: width(level)]]
        level_best.append(float(top.values[0].exp()))
        if gate is not None and gate(level, top.values, logp[int(top.indices[0]) // top_k]):
            return Candidates(tokens, parents, scores, level_best, level, levels)
    return Candidates(tokens, parents, scores, level_best, None, levels)


def draft_steps_of(inner, ctx: DraftContext, gate: Gate | None = None) -> Generator:
    """An inner tree drafter's ``draft`` as steps (``core.drafter.steps_of`` for inner drafters): its own
    ``draft_steps`` if it batches, else ``draft`` run whole."""
    steps = getattr(inner, "draft_steps", None)
    if steps is not None:
        return (yield from steps(ctx, gate))
    return inner.draft(ctx, gate)


def rerank(c: Candidates, budget: int) -> tuple[list[int], list[int], list[int]]:
    """Keep the top ``budget`` candidates (ties: generation order), in generation order.

    Returns ``(tokens, parents, kept)`` for a tree whose node 0 is the root: ``tokens``/``parents`` exclude
    the root (parents index the returned tree, 0 = root), ``kept`` are the chosen candidate indices.
    """
    order = sorted(range(len(c.tokens)), key=lambda i: (-c.scores[i], i))[:budget]
    kept = sorted(order)
    pos = {cand: n + 1 for n, cand in enumerate(kept)}
    tokens = [c.tokens[i] for i in kept]
    parents = []
    for i in kept:
        p = c.parents[i]
        if p != -1 and p not in pos:
            raise AssertionError("rerank produced a selection that is not prefix-closed")
        parents.append(0 if p == -1 else pos[p])
    return tokens, parents, kept


def candidates_tree(ctx, cands: Candidates | None, budget: int) -> Tree:
    """The dense dynamic tree: root ``ctx.ids[-1]`` plus the best ``budget`` candidates (none: the root alone)."""
    if cands is None or budget <= 0:
        return Tree.chain(ctx.ids[-1], [])
    tokens, parents, _ = rerank(cands, budget)
    return Tree.build([ctx.ids[-1], *tokens], [-1, *parents], [0] + [SOURCE_DRAFT] * len(tokens))
