"""Prompt lookup sized by this machine's cost curve (``pld`` with ``length=cost``).

Plain PLD drafts ``budget`` tokens whenever any suffix n-gram matches, right or wrong. On a backend whose
verify cost grows with every token (llama.cpp on x86: a 2-token decode costs 1.7-1.9x a 1-token one), that
wider decode is paid on every weak match, so only budget 1 breaks even (docs/backends.md, issue 26). Here
each step drafts the length that maximises the expected committed tokens per second:

    L* = argmax_{0 <= L <= budget}  (1 + sum of the L best node estimates) / cost(L + 1)

- candidates: the distinct continuations of the suffix's earlier occurrences (Graft's context source,
  :func:`.context.find_matches`), merged into a trie;
- node estimates: a chain's ``j``-th token is accepted with ``p * c^(j-1)``, where ``p`` (first token) and ``c``
  (each further token) are per match-length bucket and per request: Beta posteriors whose prior means come from
  the calibrated context table (:class:`.context.ContextModel`) and whose evidence is this request's own
  verifications (:class:`AcceptanceRecord`). A request that keeps copying verbatim soon has ``c`` near 1 and
  drafts long; one whose matches fail stops drafting;
- ``cost``: the target backend's measured verify latency by width (``costs.backend_curve``), handed in.

``L* = 0`` (no match, or none worth its width) is an AR step. A long match on a steep curve still drafts long
(a verbatim copy is accepted nearly whole), a one-token match on the same curve drafts nothing: the
"draft only on a match, then draft long" policy of llama.cpp's ngram modes, decided by numbers instead of a
fixed n-gram size. Candidates are fixed before verification, so outputs stay lossless.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..core.drafter import DraftContext
from ..core.tree import SOURCE_CONTEXT, SOURCE_ROOT, Tree, depths
from ..core.verify import walk
from .context import PRIOR_STRENGTH, ContextModel, Match, bucket, context_trie, find_matches, take_trie

MAX_DEPTH = 64  # longest chain considered (past the table's DEPTH the estimates continue geometrically)


class AcceptanceRecord:
    """Per match-length bucket: the first token's and each further token's acceptance, as Beta posteriors (prior
    mean from the table, ``strength`` pseudo-observations) updated by this request's verifications."""

    def __init__(self, model: ContextModel, strength: float = PRIOR_STRENGTH):
        self.strength = strength
        self.first0, self.cont0 = [], []
        for row in model.table:
            k = len(row) - 1
            self.first0.append(row[0])
            self.cont0.append((row[k] / row[0]) ** (1 / k) if row[0] > 0 and row[k] > 0 else 0.5)
        n = len(model.table)
        self.first = [[0, 0] for _ in range(n)]  # [accepted, offered]
        self.cont = [[0, 0] for _ in range(n)]

    def rates(self, b: int) -> tuple[float, float]:
        s = self.strength
        first = (self.first0[b] * s + self.first[b][0]) / (s + self.first[b][1])
        cont = (self.cont0[b] * s + self.cont[b][0]) / (s + self.cont[b][1])
        return first, cont

    def values(self, match: Match) -> list[float]:
        first, cont = self.rates(bucket(match.length))
        return [first * cont ** j for j in range(len(match.tokens))]

    def update(self, b: int, accepted: int, continued: bool) -> None:
        """A chain of bucket ``b`` was offered: ``accepted`` of its tokens were, and ``continued`` says whether
        a further token of it was offered and rejected (else the accepted run is censored, not a failure)."""
        self.first[b][1] += 1
        self.first[b][0] += accepted > 0
        if accepted > 0:
            self.cont[b][0] += accepted - 1
            self.cont[b][1] += accepted - 1 + continued


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


def kept_prefix(chain: tuple[int, ...], node_of: dict[tuple[int, int], int], keep: set[int]) -> tuple[int, ...]:
    """The part of ``chain`` the tree holds: its path in the trie (``node_of``: (parent, token) -> 1-based node)
    while the nodes are kept."""
    node, depth = 0, 0
    while depth < len(chain) and node_of.get((node, chain[depth])) in keep:
        node = node_of[(node, chain[depth])]
        depth += 1
    return chain[:depth]


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
        self.record = AcceptanceRecord(self.model)
        self._offered: list[tuple[int, tuple[int, ...]]] = []  # this step's chains: (bucket, tokens kept)
        self.counters = {"steps": 0, "drafting_steps": 0, "offered": 0, "accepted": 0}

    def fork(self) -> "CostSizedLookup":
        return CostSizedLookup(self.cost, self.model, self.max_ngram, self.chains, self.curve_source)

    def start(self, prompt_ids, prefill_logits, prefill_hidden=None) -> None:
        self.record = AcceptanceRecord(self.model)

    def propose(self, ctx: DraftContext) -> Tree:
        self.counters["steps"] += 1
        self._offered = []
        depth = min(ctx.budget, MAX_DEPTH)
        matches = find_matches(ctx.ids, self.max_ngram, self.chains, depth) if depth > 0 else []
        if not matches:
            return Tree.chain(ctx.ids[-1], [])
        tokens, parents, values = context_trie(matches, [self.record.values(m) for m in matches])
        n = best_length(sorted(values, reverse=True), self.cost, ctx.budget)
        if n == 0:
            return Tree.chain(ctx.ids[-1], [])
        keep = take_trie(tokens, parents, values, n)  # 1-based trie nodes, parents first
        index = {node: i + 1 for i, node in enumerate(keep)}
        kept = [tokens[k - 1] for k in keep]
        node_of, kept_set = {(par, tok): i + 1 for i, (tok, par) in enumerate(zip(tokens, parents))}, set(keep)
        self._offered = [(bucket(m.length), chain) for m in matches
                         if (chain := kept_prefix(m.tokens, node_of, kept_set))]
        self.counters["drafting_steps"] += 1
        self.counters["offered"] += len(keep)
        return Tree.build([ctx.ids[-1], *kept], [-1, *(index.get(parents[k - 1], 0) for k in keep)],
                          [SOURCE_ROOT, *[SOURCE_CONTEXT] * len(keep)])

    def observe(self, tree: Tree, logits: torch.Tensor, verdict, hidden=None) -> None:
        path = tree.tokens[verdict.accepted[1:]].tolist()
        self.counters["accepted"] += len(path)
        for b, chain in self._offered:  # the chain the path followed learns its run, the others a first miss
            common = min(len(path), len(chain))
            run = next((j for j in range(common) if path[j] != chain[j]), common)
            self.record.update(b, run, continued=run < len(chain))
        self._offered = []

    def describe(self) -> dict:
        c = self.counters
        return {"method": self.name, "length": "cost", "max_ngram": self.max_ngram, "chains": self.chains,
                "context_model": self.model.source, "curve": self.curve_source,
                "drafting_share": round(c["drafting_steps"] / c["steps"], 4) if c["steps"] else None,
                "hit_rate": round(c["accepted"] / c["offered"], 4) if c["offered"] else None}


def replay(lookup: CostSizedLookup, sequences: list[tuple[list[int], int]], budget: int) -> dict:
    """Greedy decoding of stored greedy decodes ``(ids, prompt_len)`` replayed exactly: each step's tree is what
    ``lookup`` proposes on the committed ids, its accepted path what the stored text continues with (greedy
    verification accepts exactly that), its cost ``lookup.cost(tree size)``. Returns the decoded tokens, steps,
    the summed verify cost and the host time ``propose`` + ``observe`` took here (``--method auto``)."""
    tokens = steps = 0
    verify_s = host_s = 0.0
    for ids, prompt_len in sequences:
        ids = list(ids)
        lookup.start(ids[:prompt_len], None)
        t = prompt_len
        while t < len(ids):
            start = time.perf_counter()
            tree = lookup.propose(DraftContext(ids[:t], budget=budget))
            want = [ids[t + d] if t + d < len(ids) else -1 for d in depths(tree.parent_list)]
            verdict = walk(tree, want)
            lookup.observe(tree, None, verdict)
            host_s += time.perf_counter() - start
            verify_s += lookup.cost(tree.size)
            committed = min(len(verdict.accepted), len(ids) - t)  # the accepted path plus the bonus token
            tokens, steps, t = tokens + committed, steps + 1, t + committed
    return {"tokens": tokens, "steps": steps, "verify_s": verify_s, "host_s": host_s}


__all__ = ["AcceptanceRecord", "CostSizedLookup", "best_length", "replay"]
