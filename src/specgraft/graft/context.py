"""Context retrieval for Graft: prompt-lookup continuations as a second source for the freed slots.

Where the last tokens of the committed sequence occurred earlier (prompt or output), what followed them is
a candidate chain (``find_matches``). Each chain node gets a calibrated estimate of its acceptance,
``P(the chain's first j tokens are accepted | match length bucket)`` (``ContextModel``), scaled by how
context chains fared so far in this request; the matrix's template nodes get their prior path weights
(calibrated rank hit rates). The freed slots go to the highest estimates of both (``split_slots``), the
context trie is merged first, the matrix template fills what is left. Example (``max_ngram = 3``)::

    ids     = ... the cat sat on the mat . the cat      suffix "the cat" (n = 2) occurred at 0..1
    match   = start 2, length 2 (extended backwards: ". the cat" vs "on the cat"? no -> 2)
    chain   = sat on the mat . the cat                  (up to ``depth`` tokens, cut at the end of ids)
    values  = table[bucket(2)] = .62 .55 .50 ...        (per depth; times this request's factor)

Every candidate is fixed before verification (a function of the committed ids and the state), so the
tree stays lossless under the ordinary rule. In our words, with the worked examples the tests assert:
docs/design.md §5.10.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# Match-length buckets by lower edge: 1, 2, 3, 4-7, 8-15, 16+ tokens matched before the continuation.
BUCKETS = (1, 2, 3, 4, 8, 16)
MAX_MATCH = 32  # backward extension cap (bucket 16+ needs no more)
DEPTH = 16  # longest chain considered
MAX_HITS = 64  # most recent occurrences examined per step
MIN_TRIALS = 30  # a table cell fitted from fewer observations keeps the prior
# Prior (no calibration): first-token acceptance by bucket, then a constant continuation rate.
PRIOR_FIRST = (0.25, 0.4, 0.55, 0.7, 0.8, 0.9)
PRIOR_CONTINUE = 0.85
PRIOR_STRENGTH = 4.0  # expected tokens of evidence before a request's own record moves the estimates


@dataclass(frozen=True)
class Match:
    start: int  # index in ids where the continuation begins
    length: int  # tokens matched before it (measured backwards, capped at MAX_MATCH)
    tokens: tuple[int, ...]  # the continuation


def bucket(length: int) -> int:
    """Index into BUCKETS of a match length (>= 1)."""
    return max(i for i, edge in enumerate(BUCKETS) if length >= edge)


def find_matches(ids, max_ngram: int = 3, max_chains: int = 4, depth: int = DEPTH) -> list[Match]:
    """Earlier occurrences of the longest suffix n-gram (n <= ``max_ngram``) that occurs, as distinct
    continuations: longest backward match first, then most recent. Empty when nothing matches."""
    ids = np.asarray(ids)
    t = len(ids)
    for n in range(min(max_ngram, t - 1), 0, -1):
        windows = sliding_window_view(ids[: t - 1], n)  # occurrences that end before the last token
        hits = np.flatnonzero((windows == ids[t - n:]).all(axis=1))[-MAX_HITS:]
        if not hits.size:
            continue
        length = np.full(hits.size, n)
        alive = np.ones(hits.size, dtype=bool)
        for back in range(1, MAX_MATCH - n + 1):  # extend every hit backwards in lockstep
            pos = hits - back
            alive &= (pos >= 0) & (ids[np.maximum(pos, 0)] == ids[t - n - back]) if t - n - back >= 0 else False
            if not alive.any():
                break
            length += alive
        out: list[Match] = []
        seen: set[tuple[int, ...]] = set()
        for i in sorted(range(hits.size), key=lambda i: (-length[i], -hits[i])):
            start = int(hits[i]) + n
            toks = tuple(ids[start: min(start + depth, t)].tolist())
            if toks and toks not in seen:
                seen.add(toks)
                out.append(Match(start, int(length[i]), toks))
                if len(out) == max_chains:
                    break
        return out
    return []


@dataclass(frozen=True)
class ContextModel:
    """``table[b][j - 1]`` = P(a chain's first j tokens are accepted | its match is in bucket b), non-increasing
    in j. ``source`` says where it came from (a calibration directory's fit, or the prior)."""

    table: tuple[tuple[float, ...], ...]
    source: str = "prior"

    @staticmethod
    def prior() -> "ContextModel":
        return ContextModel(tuple(tuple(p * PRIOR_CONTINUE ** j for j in range(DEPTH)) for p in PRIOR_FIRST))

    @staticmethod
    def from_fit(fit: dict | None, source: str) -> "ContextModel":
        if not fit or "table" not in fit:
            return ContextModel.prior()
        return ContextModel(tuple(tuple(row) for row in fit["table"]), source)

    def values(self, match: Match, factor: float = 1.0) -> list[float]:
        row = self.table[bucket(match.length)]
        return [min(0.999, row[min(j, len(row) - 1)] * factor) for j in range(len(match.tokens))]


def request_factor(accepted: float, expected: float, strength: float = PRIOR_STRENGTH) -> float:
    """How this request's context chains did against their estimates so far (1 with no evidence)."""
    return (accepted + strength) / (expected + strength)


def context_trie(matches: list[Match], values: list[list[float]]) -> tuple[list[int], list[int], list[float]]:
    """Chains as a trie under the root (node 0, not returned): ``(tokens, parents, values)`` in the order of
    first appearance, parents index the full trie (0 = root); a shared node keeps its best value."""
    tokens: list[int] = []
    parents: list[int] = []
    vals: list[float] = []
    index: dict[tuple[int, int], int] = {}
    for m, vs in zip(matches, values):
        par = 0
        for tok, v in zip(m.tokens, vs):
            node = index.get((par, tok))
            if node is None:
                tokens.append(tok)
                parents.append(par)
                vals.append(v)
                node = index[(par, tok)] = len(tokens)
            else:
                vals[node - 1] = max(vals[node - 1], v)
            par = node
    return tokens, parents, vals


def split_slots(ctx_values: list[float], matrix_values: list[float], slots: int) -> int:
    """How many of ``slots`` the context gets: its nodes among the ``slots`` highest estimates of both
    sources (ties go to the matrix, the paper's source). Both lists are prefix-closed when sorted, because
    an estimate never grows along a path."""
    ranked = sorted([(-v, 0) for v in matrix_values] + [(-v, 1) for v in ctx_values])[:slots]
    return sum(src for _, src in ranked)


def take_trie(tokens: list[int], parents: list[int], values: list[float], n: int) -> list[int]:
    """Indices (1-based trie nodes) of the ``n`` best nodes, prefix-closed (a parent before its children)."""
    order = sorted(range(len(tokens)), key=lambda i: (-values[i], i))[:n]
    keep = set(i + 1 for i in order)
    return [i for i in sorted(keep) if parents[i - 1] == 0 or parents[i - 1] in keep]


def fit_context(sequences: list[tuple[list[int], int]], max_ngram: int = 3, max_chains: int = 4) -> dict:
    """The acceptance table from greedy decodes: at every output position of each ``(ids, prompt_len)``
    the chains ``find_matches`` would offer are compared with what the target actually wrote next.
    Cells with fewer than MIN_TRIALS observations keep the prior; each row is made non-increasing."""
    trials = np.zeros((len(BUCKETS), DEPTH), dtype=np.int64)
    hits = np.zeros((len(BUCKETS), DEPTH), dtype=np.int64)
    positions = 0
    for ids, prompt_len in sequences:
        arr = np.asarray(ids)
        for t in range(prompt_len + 1, len(arr)):
            positions += 1
            for m in find_matches(arr[:t], max_ngram, max_chains):
                truth = arr[t: t + len(m.tokens)]
                agree = np.asarray(m.tokens[: len(truth)]) == truth
                acc = int(agree.argmin()) if not agree.all() else len(truth)
                b = bucket(m.length)
                trials[b, : len(truth)] += 1
                hits[b, :acc] += 1
    prior = ContextModel.prior().table
    table = []
    for b in range(len(BUCKETS)):
        row, last = [], 1.0
        for j in range(DEPTH):
            rate = hits[b, j] / trials[b, j] if trials[b, j] >= MIN_TRIALS else prior[b][j]
            last = min(last, float(rate))
            row.append(round(last, 4))
        table.append(row)
    return {"table": table, "buckets": list(BUCKETS), "trials": trials.tolist(), "hits": hits.tolist(),
            "positions": positions, "sequences": len(sequences), "max_ngram": max_ngram, "max_chains": max_chains,
            "min_trials": MIN_TRIALS,
            "rule": f"per bucket and depth: accepted / offered over output positions; < {MIN_TRIALS} -> prior"}
