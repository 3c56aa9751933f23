"""Graft's pure parts: the stage budget split, retrieval templates, and the shared-root trie merge.

A pruned draft tree frees verification slots; Graft fills them with a *retrieval template* read from the
adjacency matrix (``M[x, r]`` = the target's r-th successor of ``x``) and grafted under the same root::

    pruned draft (stage 1: 3 of 6 slots)     retrieval (3 slots)          hybrid (6 slots)
        r                                    r                            r
        ├── a (draft)                        ├── M[r,0] = a   (dup)       ├── a (draft)
        │   └── c (draft)                    │   └── M[a,0] = d           │   ├── c (draft)
        └── b (draft)                        └── M[r,1] = e               │   └── d (retrieval)
                                                 └── M[e,0] = f           ├── b (draft)
                                                                          └── e (retrieval)
                                                                              ... f does not fit: 6 slots

A retrieved node equal to an existing sibling is merged into it (costs no slot); its children still attach.
Templates are asymmetric: the rank-0 chain goes deepest, lower ranks stay shallow (see ``build_template``).

In our words, with the worked examples the tests assert: docs/design.md §5.3, §5.4.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..drafters.matrix import compile_template

# Stage s fires at checkpoint level (0, 1, 5)[s]; the paper's split of K_max = 60 is 8/52, 24/36, 40/20.
STAGE_SHARES = (8 / 60, 24 / 60, 40 / 60)
ROOT_SHARE = 20 / 60  # Graft(ROOT): retrieval share taken from an unpruned tree
# Level widths at 52 / 36 / 20 retrieval slots (stage 0 is the paper's; 1 and 2 follow its profile).
STAGE_WIDTHS = ((8, 10, 8, 6, 5, 4, 4, 4, 3), (8, 8, 6, 5, 3, 2, 2, 2), (6, 4, 3, 2, 2, 1, 1, 1))
DEPTH_PROFILE = (8, 10, 8, 6, 5, 4, 4, 4, 3, 3, 3, 3)  # for depth sweeps beyond 9 levels
RANK_WEIGHTS = (0.55, 0.15, 0.07, 0.045, 0.03, 0.02, 0.015, 0.01)
RESERVE = 16  # extra rank paths consumed when duplicates leave slots free


def stage_split(budget: int) -> tuple[int, ...]:
    """Draft nodes kept per stage, ``max(1, round(share * budget))``; the rest are retrieval slots."""
    return tuple(min(budget, max(1, round(share * budget))) for share in STAGE_SHARES)


@dataclass(frozen=True)
class Template:
    """Rank paths from the root: the first ``n_template`` are the template, the rest its reserve."""

    paths: tuple[tuple[int, ...], ...]
    n_template: int

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(parents, ranks, depths) over ``1 + len(paths)`` nodes, node 0 the root."""
        return compile_template(self.paths)

    def levels(self) -> list[list[str]]:
        """Paths per level as rank strings (``"010"``), template only: the golden-test view."""
        out: list[list[str]] = []
        for p in self.paths[: self.n_template]:
            out.extend([] for _ in range(len(p) - len(out)))
            out[len(p) - 1].append("".join(map(str, p)))
        return out


def path_weight(path: tuple[int, ...], weights: tuple[float, ...]) -> float:
    w = 1.0
    for r in path:
        w *= weights[r] if r < len(weights) else 0.0
    return w


@lru_cache(maxsize=256)
def build_template(level_widths: tuple[int, ...], rank_weights: tuple[float, ...] = RANK_WEIGHTS, k: int = 8,
                   reserve: int = RESERVE) -> Template:
    """Level by level keep the ``w_l`` children ``(parent, r)`` of the previous level with the highest prior
    path weight ``prod(rank_weights[r_i])`` (ties: parent order, then rank), stored in (parent, rank) order.
    Then ``reserve`` more paths: the best-weighted children of placed nodes, one at a time, no deeper than
    the template.
    """
    paths: list[tuple[int, ...]] = []
    prev: list[tuple[int, ...]] = [()]
    for width in level_widths:
        cands = [(p + (r,), i, r) for i, p in enumerate(prev) for r in range(k)]
        cands.sort(key=lambda c: (-path_weight(c[0], rank_weights), c[1], c[2]))
        chosen = sorted(cands[:width], key=lambda c: (c[1], c[2]))
        prev = [c[0] for c in chosen]
        if not prev:
            break
        paths.extend(prev)
    n_template = len(paths)
    placed = set(paths) | {()}
    max_depth = len(level_widths)
    order = {p: i for i, p in enumerate([(), *paths])}
    for _ in range(reserve):
        best = None
        for p in list(placed):
            if len(p) >= max_depth:
                continue
            for r in range(k):
                c = p + (r,)
                if c in placed:
                    continue
                key = (-path_weight(c, rank_weights), len(c), order[p], r)
                if best is None or key < best[0]:
                    best = (key, c)
        if best is None or best[0][0] == 0.0:
            break
        placed.add(best[1])
        order[best[1]] = len(order)
        paths.append(best[1])
    return Template(tuple(paths), n_template)


def scale_widths(widths: tuple[int, ...], slots: int, k: int = 8, cap: int | None = None) -> tuple[int, ...]:
    """Level widths in the proportions of ``widths`` summing to ``slots`` (largest remainder), each level at
    least 1, at most ``cap`` and at most ``k`` times the level above; with few slots the deepest levels go
    (those whose share would be under 3/4 of a node)."""
    if slots <= 0:
        return ()
    widths = list(widths[:slots])
    while len(widths) > 1 and widths[-1] * slots / sum(widths) < 0.75:  # too few slots for this depth
        widths.pop()
    total = sum(widths)
    exact = [w * slots / total for w in widths]
    out = [max(1, int(e)) for e in exact]
    for _ in range(4 * slots):  # settle rounding and caps
        limit = [min(cap or 1 << 30, k * (out[i - 1] if i else 1)) for i in range(len(out))]
        out = [min(o, lim) for o, lim in zip(out, limit)]
        diff = slots - sum(out)
        if diff == 0:
            break
        order = sorted(range(len(out)), key=lambda i: -(exact[i] - out[i]) if diff > 0 else (exact[i] - out[i]))
        moved = False
        for i in order:
            if diff > 0 and out[i] < limit[i]:
                out[i] += 1
                moved = True
                break
            if diff < 0 and out[i] > 1:
                out[i] -= 1
                moved = True
                break
        if not moved:
            break
    return tuple(out)


def stage_template(stage: int, slots: int, rank_weights: tuple[float, ...] = RANK_WEIGHTS, k: int = 8) -> Template:
    """The stage's retrieval template at ``slots`` nodes (its default shape, scaled proportionally)."""
    return build_template(scale_widths(STAGE_WIDTHS[stage], slots, k), tuple(rank_weights), k)


def sweep_template(slots: int, depth: int, width: int, rank_weights: tuple[float, ...] = RANK_WEIGHTS,
                   k: int = 8) -> Template:
    """Template with ``depth`` levels and at most ``width`` nodes per level (the depth/width ablations)."""
    profile = tuple(DEPTH_PROFILE[min(i, len(DEPTH_PROFILE) - 1)] for i in range(depth))
    return build_template(scale_widths(profile, slots, k, cap=width), tuple(rank_weights), k)


@dataclass(frozen=True)
class Hybrid:
    tokens: list[int]  # root first
    parents: list[int]
    source: list[int]
    n_draft: int  # non-root draft nodes
    n_retrieved: int  # new retrieval nodes
    n_dedup: int  # retrieved nodes that coincided with an existing node (no slot used)
    added_from: list[int]  # for each new node (in order), its index in ``retrieved``


def graft_merge(tokens: list[int], parents: list[int], retrieved: list[int], tpl_parents: np.ndarray,
                slots: int, n_template: int, dedup: str = "merge", source_draft: int = 1,
                source_retrieval: int = 2, row=None, source: list[int] | None = None) -> Hybrid:
    """Merge template nodes (``retrieved[u]`` = token or -1, ``tpl_parents[u]`` its template parent, node 0
    the root) into the draft tree ``tokens``/``parents`` (root first) by token identity under the same
    parent, adding at most ``slots`` new nodes; template first, then the reserve while slots remain.

    A duplicate never takes a slot of its own (the verification walk enters only the first of equal siblings,
    so a second copy and its subtree would be unreachable). ``dedup="skip"``: a duplicate still merges (its
    children attach), and its slot goes to the next rank of the parent's matrix row (``row(token) ->
    successors``) that is not already a child there. ``source`` labels the existing nodes (default: root, then
    draft), so a second source can be merged into a tree that already holds a first.
    """
    out_t, out_p = list(tokens), list(parents)
    source = list(source) if source is not None else [0] + [source_draft] * (len(tokens) - 1)
    added_from: list[int] = []
    index = {(p, t): i for i, (p, t) in enumerate(zip(out_p, out_t)) if i > 0}
    merged = {0: 0}
    added = dup = 0
    last = len(retrieved) if dedup == "merge" else n_template + 1  # the reserve serves "merge" only
    for u in range(1, last):
        tok, tp = int(retrieved[u]), int(tpl_parents[u])
        if tok < 0 or tp not in merged:
            continue
        m_par = merged[tp]
        if (m_par, tok) in index:
            merged[u] = index[(m_par, tok)]
            dup += 1
            if dedup == "skip" and row is not None and added < slots:
                alt = next((t for t in row(out_t[m_par]) if t >= 0 and (m_par, t) not in index), None)
                if alt is not None:  # the next unused rank at the same parent, as a leaf
                    out_t.append(alt)
                    out_p.append(m_par)
                    source.append(source_retrieval)
                    index[(m_par, alt)] = len(out_t) - 1
                    added_from.append(u)
                    added += 1
            continue
        if added >= slots:
            break
        out_t.append(tok)
        out_p.append(m_par)
        source.append(source_retrieval)
        merged[u] = len(out_t) - 1
        index.setdefault((m_par, tok), merged[u])
        added_from.append(u)
        added += 1
    return Hybrid(out_t, out_p, source, len(tokens) - 1, added, dup, added_from)
