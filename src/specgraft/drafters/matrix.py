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

# Columns per block in :func:`blocked_topk`: a block's maximum is one vector reduction, and the k best blocks'
# k * 128 columns make a second top-k that costs next to nothing.
BLOCK = 128
# top_indices: fewer entries than this take one selection (so do rows whose candidates would be a large share of
# them): the blocked top-k's extra calls cost ~0.08 ms, more than it saves on one 49,152-column row (a Zen 4 EPYC:
# 0.20 against 0.12 ms in bf16, docs/serving.md "The matrix update's top-k, blocked")
SMALL = 1 << 17


def full_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``torch.topk``'s columns over the whole row (``AdjacencyMatrix.blocked_topk = False``)."""
    return torch.topk(logits, k, dim=-1).indices


def block_maxima(blocks: torch.Tensor) -> torch.Tensor:
    """``[..., n, BLOCK] -> [..., n]`` keys ordered as the blocks' maxima. ``amax`` itself, except on 2-byte floats
    (bf16, fp16), whose ``amax`` is slower on CPU than a reduction over their bits as int16 (measured ~3x): those
    bits order non-negative values as the floats do and negative values in reverse, so a block's maximum is its
    largest bits when it holds a non-negative value, else its smallest bits, flipped below every non-negative."""
    if blocks.element_size() != 2 or not blocks.is_floating_point():
        return blocks.amax(-1)
    bits = blocks.view(torch.int16)
    high, low = bits.amax(-1), bits.amin(-1)
    return torch.where(high >= 0, high, low ^ 0x7FFF)


def top_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`full_topk` for ``logits [W, V]``: :func:`blocked_topk` where it saves time, else one selection."""
    rows, vocab = logits.shape
    if vocab // BLOCK < 4 * k or rows * vocab < SMALL:
        return full_topk(logits, k)
    return blocked_topk(logits, k)


def blocked_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`full_topk` for ``logits [W, V]`` (``V >= k * BLOCK``; descending) without a selection over all
    ``V`` columns of every row, the matrix update's main cost on a large vocabulary (docs/serving.md,
    "The matrix update's top-k, blocked"):

        block maxima   [W, V // BLOCK]          one reduction over the row
        best k blocks  [W, k]                   top-k of the maxima
        candidates     [W, k * BLOCK + tail]    those blocks' columns, plus the columns past the last full block
        result         [W, k]                   top-k of the candidates, mapped back to columns

    Exact: an entry among a row's k largest lies in one of the k blocks with the largest maxima (outside them,
    k block maxima, each a different entry, are at least as large). The values equal ``torch.topk``'s, and so do
    the columns unless entries tie at the k-th value (then each may pick another of the tied columns)."""
    rows, vocab = logits.shape
    blocks = vocab // BLOCK
    full = logits[:, : blocks * BLOCK].unflatten(-1, (blocks, BLOCK))  # a view, whatever the strides
    best = torch.topk(block_maxima(full), k, dim=-1).indices  # [W, k]
    cand = torch.gather(full, 1, best.unsqueeze(-1).expand(rows, k, BLOCK)).flatten(1)  # [W, k * BLOCK]
    cols = (best.unsqueeze(-1) * BLOCK + torch.arange(BLOCK, device=logits.device)).flatten(1)
    if blocks * BLOCK < vocab:  # the tail that fills no block: every column is a candidate
        cand = torch.cat([cand, logits[:, blocks * BLOCK:]], 1)
        tail = torch.arange(blocks * BLOCK, vocab, device=logits.device)
        cols = torch.cat([cols, tail.expand(rows, -1)], 1)
    return torch.gather(cols, 1, torch.topk(cand, k, dim=-1).indices)


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

    # False: updates take torch.topk over the whole vocabulary (scripts/matrix_topk_cost.py and
    # scripts/draft_batch_cost.py --plain-topk measure the difference)
    blocked_topk = True

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
        top = top_indices if self.blocked_topk else full_topk
        if len(last) == len(toks):  # no repeats (the usual tree): no copy of [W, V] rows before the top-k
            self.table[tokens, :k] = top(logits, k)
            return
        idx = torch.tensor(last, dtype=torch.long)
        self.table[tokens[idx], :k] = top(logits.index_select(0, idx), k)

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
