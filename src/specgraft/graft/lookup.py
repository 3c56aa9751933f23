"""Prompt lookup sized by this machine's cost curve (``pld`` with ``length=cost``).

Plain PLD drafts ``budget`` tokens whenever any suffix n-gram matches, right or wrong. On a backend whose
verify cost grows with every token (llama.cpp on x86: a 2-token decode costs ~1.9x a 1-token one), that
wider decode is paid on every weak match, so only budget 1 breaks even (docs/backends.md, issue 26). Here
each step drafts the length that maximises the expected committed tokens per second:

    L* = argmax_{0 <= L <= budget}  (1 + sum of the L best node estimates) / cost(L + 1)

- candidates: the distinct continuations of the suffix's earlier occurrences (Graft's context source,
  :func:`.context.find_matches`), merged into a trie;
- node estimates: ``P(the chain's first j tokens are accepted | match length)`` from the calibrated context
  table (:class:`.context.ContextModel`), scaled by how this request's chains fared so far
  (:func:`.context.request_factor`), and continued geometrically past the table's depth;
- ``cost``: the target backend's measured verify latency by width (``costs.backend_curve``), handed in.

``L* = 0`` (no match, or none worth its width) is an AR step. A long match on a steep curve still drafts long
(a verbatim copy is accepted nearly whole), a one-token match on the same curve drafts nothing: the
"draft only on a match, then draft long" policy of llama.cpp's ngram modes, decided by numbers instead of a
fixed n-gram size. Candidates are fixed before verification, so outputs stay lossless.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..core.drafter import DraftContext
from ..core.tree import SOURCE_CONTEXT, SOURCE_ROOT, Tree
from .context import ContextModel, Match, bucket, context_trie, find_matches, request_factor, take_trie

MAX_DEPTH = 64  # longest chain considered (past the table's DEPTH the estimates continue geometrically)


def chain_values(model: ContextModel, match: Match, factor: float = 1.0) -> list[float]:
    """Estimates for every token of ``match``: the table's row, then its last step's ratio repeated (the
    table stops at DEPTH; a flat continuation would overrate long chains)."""
    row = model.table[bucket(match.length)]
    ratio = min(1.0, row[-1] / row[-2]) if len(row) > 1 and row[-2] > 0 else 0.0
    out = []
    for j in range(len(match.tokens)):
        base = row[j] if j < len(row) else row[-1] * ratio ** (j - len(row) + 1)
        out.append(min(0.999, base * factor))
    return out


def best_length(gains: list[float], cost: Callable[[int], float], budget: int) -> int:
    """``argmax_L (1 + gains[0] + ... + gains[L - 1]) / cost(L + 1)`` over ``0 <= L <= min(budget, len(gains))``;
    ``gains`` sorted best first. Ties go to the shorter tree."""
    best, best_rate, total = 0, 1.0 / cost(1), 1.0
    for n, g in enumerate(gains[:budget], start=1):
        total += g
        rate = total / cost(n + 1)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


class CostSizedLookup:
    """PLD whose draft length per step is chosen from the cost curve (module docstring). ``cost(w)``: seconds
    for one verify of ``w`` tokens on the target."""

    name = "pld"
    needs_prefill_logits = False
    hidden_layers = ()
    forward_s = 0.0

    def __init__(self, cost: Callable[[int], float], model: ContextModel | None = None, max_ngram: int = 3,
                 chains: int = 4, curve_source: str = "measured"):
        for key, val in (("max_ngram", max_ngram), ("chains", chains)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"pld needs an integer {key} >= 1, got {val!r}")
        self.cost, self.model = cost, model or ContextModel.prior()
        self.max_ngram, self.chains, self.curve_source = max_ngram, chains, curve_source
        self._record = {"accepted": 0.0, "expected": 0.0}  # this request's context tokens: accepted, estimated
        self.counters = {"steps": 0, "drafting_steps": 0, "offered": 0, "accepted": 0}

    def fork(self) -> "CostSizedLookup":
        return CostSizedLookup(self.cost, self.model, self.max_ngram, self.chains, self.curve_source)

    def start(self, prompt_ids, prefill_logits, prefill_hidden=None) -> None:
        self._record = {"accepted": 0.0, "expected": 0.0}

    def propose(self, ctx: DraftContext) -> Tree:
        self.counters["steps"] += 1
        depth = min(ctx.budget, MAX_DEPTH)
        matches = find_matches(ctx.ids, self.max_ngram, self.chains, depth) if depth > 0 else []
        if not matches:
            return Tree.chain(ctx.ids[-1], [])
        factor = request_factor(self._record["accepted"], self._record["expected"])
        tokens, parents, values = context_trie(matches, [chain_values(self.model, m, factor) for m in matches])
        n = best_length(sorted(values, reverse=True), self.cost, ctx.budget)
        if n == 0:
            return Tree.chain(ctx.ids[-1], [])
        keep = take_trie(tokens, parents, values, n)  # 1-based trie nodes, parents first
        index = {node: i + 1 for i, node in enumerate(keep)}
        self._record["expected"] += sum(values[k - 1] for k in keep)
        self.counters["drafting_steps"] += 1
        self.counters["offered"] += len(keep)
        return Tree.build([ctx.ids[-1], *(tokens[k - 1] for k in keep)],
                          [-1, *(index.get(parents[k - 1], 0) for k in keep)],
                          [SOURCE_ROOT, *[SOURCE_CONTEXT] * len(keep)])

    def observe(self, tree: Tree, logits: torch.Tensor, verdict, hidden=None) -> None:
        n = len(verdict.accepted) - 1
        self._record["accepted"] += n
        self.counters["accepted"] += n

    def describe(self) -> dict:
        c = self.counters
        return {"method": self.name, "length": "cost", "max_ngram": self.max_ngram, "chains": self.chains,
                "context_model": self.model.source, "curve": self.curve_source,
                "drafting_share": round(c["drafting_steps"] / c["steps"], 4) if c["steps"] else None,
                "hit_rate": round(c["accepted"] / c["offered"], 4) if c["offered"] else None}


__all__ = ["CostSizedLookup", "best_length", "chain_values"]
