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
a node whose children cannot be among them. A child never outscores its parent and comes after every node
generated before it, so if ``keep`` generated nodes already score at least as high as a node, none of its
descendants can be kept: it is not expanded (the *count rule*). Its ancestors and the nodes of its level that
outscore it are among those counted, so at most ``keep - d - 1`` nodes of level ``d`` are expanded and no level
past ``keep - 1``; the count also sees better nodes at other levels (a confident head's runner-up siblings), so
it usually stops sooner. Same kept tree: with distinct scores let ``t`` be the full run's ``keep``-th best
score. By induction over levels, every node the capped run generates that scores ``>= t`` is one the full run
keeps (its first ancestor the full run did not expand had ``top_k`` better nodes at its level, all kept, so the
capped run would not have expanded it either), hence every kept node's parent passes both the top-``k`` and
the count test in the capped run and is expanded. So the best ``keep`` candidates are the same, in the same
order, up to ties (and up to rounding: the head sees other matrix shapes); at budget 7 and ``top_k`` 10 at
most 21 rows go through the head instead of 70. Not with a gate or with anything that reads ``level_best``
(Graft's checkpoints, calibration): their inputs are the full frontier's.

In our words, with the worked examples the tests assert: docs/design.md §4.4.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass
class Pool:
    """The candidates generated so far, filled in place by :func:`expand_topk_steps` (a drafter reads the
    frontier's tokens and parents between steps instead of repeating each level's top-k)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    levels: list[int] = field(default_factory=list)


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
    (with ``keep``, only nodes the count rule allows: see the module docstring)."""
    steps = expand_topk_steps(first_logp, top_k, depth, gate, keep)
    logp = None
    while True:
        try:
            frontier = steps.send(logp)  # (a StopIteration must not escape: callers may be generators)
        except StopIteration as stop:
            return stop.value
        logp = expand(frontier)


def expandable(scores: list[float], best: list[int], keep: int | None) -> list[int]:
    """Of a level's best nodes ``best`` (candidate indices), those the count rule lets a caller keeping
    ``keep`` candidates expand: fewer than ``keep`` generated nodes score at least as high (module docstring)."""
    if keep is None or not best:
        return best
    generated = torch.tensor(scores, dtype=torch.float64)
    ahead = (generated.unsqueeze(0) >= generated[best].unsqueeze(1)).sum(1)  # [len(best)]
    return [b for b, n in zip(best, ahead.tolist()) if n < keep]


def expand_topk_steps(first_logp: torch.Tensor, top_k: int, depth: int, gate: Gate | None = None,
                      keep: int | None = None, pool: Pool | None = None
                      ) -> Generator[list[int], torch.Tensor, Candidates]:
    """:func:`expand_topk` as steps: yields each frontier (candidate indices), is sent its log-probabilities
    ``[len(frontier), V]``, returns the candidates. A batched drafter runs many requests' steps in lockstep.
    ``keep``: the caller keeps only the best ``keep`` candidates, so only what can be kept is expanded (module
    docstring). ``pool``: an empty :class:`Pool` the candidates are appended to as they are generated."""
    if keep is not None and gate is not None:
        raise ValueError("expand_topk: keep caps the frontiers a gate reads; use one or the other")
    pool = Pool() if pool is None else pool
    if pool.tokens:
        raise ValueError("expand_topk: the pool must start empty")
    tokens, parents, scores, levels = pool.tokens, pool.parents, pool.scores, pool.levels
    vals, ids = torch.topk(first_logp.float(), top_k)
    tokens.extend(ids.tolist())
    parents.extend([-1] * top_k)
    scores.extend(vals.tolist())
    levels.extend([0] * top_k)
    frontier = expandable(scores, list(range(top_k)), keep)
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
        tokens.extend(ci.flatten().tolist())
        parents.extend(f for f in frontier for _ in range(top_k))
        scores.extend(cum.flatten().tolist())
        levels.extend([level] * cum.numel())
        top = torch.topk(cum.flatten(), min(top_k, cum.numel()))
        frontier = expandable(scores, [start + b for b in top.indices.tolist()], keep)
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
