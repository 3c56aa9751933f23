"""The adjacency matrix that Token Recycling and Graft share (docs/design.md §4.2).

``M[v]`` holds the top-k tokens the target predicted the last time it processed token ``v`` (``-1`` = never
seen). Every verification overwrites the rows of every tree node's token (accepted or not) with the top-k
of that node's logits. A template of rank paths turns ``M`` into a tree, one batched gather per level.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.drafter import last_occurrences
from ..core.tree import SOURCE_RETRIEVAL, SOURCE_ROOT, Tree


def compile_template(paths: tuple[tuple[int, ...], ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank paths -> (parents, ranks, depths) over ``1 + len(paths)`` nodes, node 0 the root.

    Requires every path's prefix to appear earlier (prefix-closed, BFS order), so that any prefix of the
    node list is itself a valid tree: a budget smaller than the template keeps the first nodes.
    """
    index = {(): 0}
    parents, ranks, depths = [-1], [-1], [0]
    for path in paths:
        if path[:-1] not in index:
            raise ValueError(f"template path {path} appears before its parent {path[:-1]}")
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        ranks.append(path[-1])
        depths.append(len(path))
    return np.array(parents), np.array(ranks), np.array(depths)


class AdjacencyMatrix:
    """``[V, k]`` int64 successor table; ``-1`` marks a row never written (cold)."""

    def __init__(self, vocab_size: int, k: int = 8):
        self.k = k
        self.table = torch.full((vocab_size, k), -1, dtype=torch.long)

    def clear(self) -> None:
        self.table.fill_(-1)

    @property
    def rows_filled(self) -> int:
        return int((self.table[:, 0] >= 0).sum())

    def update(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """``M[tokens[j]] = topk(logits[j])``; a token occurring twice keeps its last occurrence."""
        toks = tokens.tolist()
        if logits.shape[0] != len(toks):
            raise ValueError(f"matrix update: {logits.shape[0]} logit rows for {len(toks)} tokens")
        last = list({t: j for j, t in enumerate(toks)}.values())  # dict keeps the last index per token
        k = min(self.k, logits.shape[-1])
        if len(last) == len(toks):  # no repeats (the usual tree): no copy of [W, V] rows before the top-k
            self.table[tokens, :k] = torch.topk(logits, k, dim=-1).indices
            return
        idx = torch.tensor(last, dtype=torch.long)
        self.table[tokens[idx], :k] = torch.topk(logits.index_select(0, idx), k, dim=-1).indices

    def update_prompt(self, prompt_ids: list[int], logits: torch.Tensor) -> None:
        """The prefill's observations: ``logits`` are the rows at ``last_occurrences(prompt_ids)`` (what the
        engine computes for a drafter that wants prefill logits; an update keeps only a token's last row)."""
        ids = torch.tensor(prompt_ids, dtype=torch.long)
        self.update(ids[torch.tensor(last_occurrences(prompt_ids), dtype=torch.long)], logits)

    def gather(self, root: int, parents: np.ndarray, ranks: np.ndarray, depths: np.ndarray) -> torch.Tensor:
        """Template node tokens, one gather per level; ``-1`` under a cold row (or rank >= k), and below it.
        In numpy on the table's memory: a template is a few dozen nodes, where torch's per-op cost dominates."""
        table = self.table.numpy()
        toks = np.full(len(parents), -1, dtype=np.int64)
        toks[0] = root
        rank_at = np.clip(ranks, 0, self.k - 1)
        rank_ok = ranks < self.k
        for d in range(1, int(depths.max(initial=0)) + 1):
            level = np.flatnonzero(depths == d)
            ptok = toks[parents[level]]
            got = table[np.maximum(ptok, 0), rank_at[level]]
            toks[level] = np.where((ptok >= 0) & rank_ok[level], got, -1)
        return torch.from_numpy(toks)

    def materialize(self, root: int, parents: np.ndarray, ranks: np.ndarray, depths: np.ndarray) -> Tree:
        """The template as a tree; nodes under a cold row (or rank >= k) are dropped with their subtree."""
        toks = self.gather(root, parents, ranks, depths)
        n = len(parents)
        keep = np.flatnonzero(toks.numpy() >= 0)  # a dropped node's descendants are dropped too
        remap = np.full(n, -1)
        remap[keep] = np.arange(len(keep))
        new_par = np.where(parents[keep] >= 0, remap[np.maximum(parents[keep], 0)], -1)
        source = np.full(len(keep), SOURCE_RETRIEVAL, dtype=np.int8)
        source[0] = SOURCE_ROOT
        return Tree(toks[torch.from_numpy(keep)], torch.from_numpy(new_par), torch.from_numpy(source))

    @property
    def populated_bytes(self) -> int:
        """Storage of the populated rows at int32 (how the Graft paper reports matrix size)."""
        return self.rows_filled * self.k * 4

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The populated rows only (``rows`` int32[n], ``succ`` int32[n, k]): small enough to ship."""
        rows = torch.nonzero(self.table[:, 0] >= 0).flatten()
        return {"rows": rows.to(torch.int32), "succ": self.table[rows].to(torch.int32)}

    def load_snapshot(self, snap: dict[str, torch.Tensor]) -> None:
        self.clear()
        rows, succ = snap["rows"].long(), snap["succ"].long()
        if succ.shape[1] != self.k or (rows.numel() and int(rows.max()) >= self.table.shape[0]):
            raise ValueError(f"matrix snapshot has k={succ.shape[1]} and rows up to {int(rows.max(initial=0))}; "
                             f"this matrix has k={self.k} and {self.table.shape[0]} rows")
        self.table[rows] = succ
