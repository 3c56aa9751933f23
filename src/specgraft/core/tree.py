"""One draft-tree type; everything else (depth, mask, positions, paths, children) is derived.

A tree is ``tokens[W]`` plus ``parents[W]`` in topological order (``parents[i] < i``). Node 0 is the
*root*: the last committed token, which is not yet in the target's KV cache. Example (the golden test,
``parents = [-1, 0, 0, 1, 1, 3]``)::

        0            depth 0   (root, position P)
       / \\
      1   2          depth 1   (position P + 1)
     / \\
    3   4            depth 2
    |
    5                depth 3

The ancestor mask row ``i`` marks ``i`` and all its ancestors; that is exactly what node ``i`` may attend
to among the tree slots (``x`` = visible)::

          0 1 2 3 4 5
      0 [ x . . . . . ]
      1 [ x x . . . . ]
      2 [ x . x . . . ]
      3 [ x x . x . . ]
      4 [ x x . . x . ]
      5 [ x x . x . x ]

The target sees the committed prefix (``P`` columns, all visible) followed by these ``W`` columns, and node
``i`` sits at position ``P + depth[i]``.

In our words, with the worked examples the tests assert: docs/design.md §3.1.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

# Where a node came from; statistics only (verification treats all candidates alike). RETRIEVAL is the
# adjacency matrix; CONTEXT is a continuation copied from earlier in the sequence (prompt lookup, Graft's
# context source).
SOURCE_ROOT, SOURCE_DRAFT, SOURCE_RETRIEVAL, SOURCE_CONTEXT = 0, 1, 2, 3


@dataclass(frozen=True, eq=False)
class Tree:
    """Candidate continuations rooted at node 0. ``tokens``/``parents``/``source`` are 1-D, length W."""

    tokens: torch.Tensor  # int64[W]
    parents: torch.Tensor  # int64[W], parents[0] == -1, parents[i] < i
    source: torch.Tensor  # int8[W]
    # Chains sampled from a draft distribution carry it: row i (i >= 1) is the q that token i was drawn from,
    # after the same processing as the target. Deterministic candidates (top-k, retrieval) leave it None.
    draft_probs: torch.Tensor | None = None  # float[W, V]

    def __post_init__(self) -> None:
        validate(self.parent_list)
        if self.draft_probs is not None and self.draft_probs.shape[0] != self.size:
            raise ValueError(f"draft_probs needs {self.size} rows (root row unused), got {self.draft_probs.shape[0]}")

    @staticmethod
    def build(tokens: list[int], parents: list[int], source: list[int] | None = None,
              draft_probs: torch.Tensor | None = None) -> "Tree":
        """``source`` defaults to root + drafted nodes."""
        source = [SOURCE_ROOT] + [SOURCE_DRAFT] * (len(tokens) - 1) if source is None else source
        return Tree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                    torch.tensor(source, dtype=torch.int8), draft_probs)

    @staticmethod
    def chain(root: int, tokens: list[int], source: int | list[int] = SOURCE_DRAFT,
              draft_probs: torch.Tensor | None = None) -> "Tree":
        """A single path ``root -> tokens[0] -> tokens[1] ...`` (PLD, draft chains); ``source`` per node or
        one for all."""
        n = len(tokens)
        src = [source] * n if isinstance(source, int) else list(source)
        return Tree.build([root, *tokens], list(range(-1, n)), [SOURCE_ROOT, *src], draft_probs)

    @property
    def size(self) -> int:
        """W: the number of verification slots, root included."""
        return int(self.tokens.shape[0])

    @cached_property
    def parent_list(self) -> list[int]:
        return self.parents.tolist()

    @cached_property
    def depth(self) -> torch.Tensor:
        return torch.tensor(depths(self.parent_list), dtype=torch.long)

    @cached_property
    def ancestors(self) -> torch.Tensor:
        return torch.from_numpy(ancestor_mask(self.parent_list))

    @cached_property
    def children(self) -> list[list[int]]:
        return children_lists(self.parent_list)

    def position_ids(self, prefix_len: int) -> torch.Tensor:
        """``[1, W]`` positions: the root sits at ``prefix_len`` because it is not cached yet."""
        return (prefix_len + self.depth).unsqueeze(0)

    def attention_mask(self, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive 4D mask ``[1, 1, W, prefix_len + W]``: 0 where visible, ``finfo.min`` elsewhere."""
        return tree_attention_mask(self.ancestors, prefix_len, dtype)

    def leaf_paths(self) -> torch.Tensor:
        return torch.tensor(leaf_paths(self.parent_list), dtype=torch.long)


def validate(parents: list[int]) -> None:
    if not parents or parents[0] != -1:
        raise ValueError("a tree needs a root with parent -1 at index 0")
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}; parents must satisfy 0 <= parents[i] < i")


def depths(parents: list[int]) -> list[int]:
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def ancestor_mask(parents: list[int]) -> np.ndarray:
    """``bool[W, W]``; row i marks i and its ancestors. Topological order makes one pass enough."""
    w = len(parents)
    anc = np.eye(w, dtype=bool)
    for i in range(1, w):
        anc[i] |= anc[parents[i]]
    return anc


def tree_attention_mask(anc: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    w = anc.shape[-1]
    mask = torch.zeros(1, 1, w, prefix_len + w, dtype=dtype)
    mask[0, 0, :, prefix_len:].masked_fill_(~anc, torch.finfo(dtype).min)
    return mask


def children_lists(parents: list[int]) -> list[list[int]]:
    """Children of each node in sibling (index) order."""
    kids: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        kids[parents[i]].append(i)
    return kids


def leaf_paths(parents: list[int]) -> list[list[int]]:
    """Root-to-leaf node paths, one per leaf in index order, padded with -1 to ``max_depth + 1``."""
    kids = children_lists(parents)
    d = depths(parents)
    width = max(d) + 1
    out = []
    for leaf in (i for i in range(len(parents)) if not kids[i]):
        path = path_to(parents, leaf)
        out.append(path + [-1] * (width - len(path)))
    return out


def path_to(parents: list[int], node: int) -> list[int]:
    """Node indices from the root to ``node``, both included."""
    path = [node]
    while parents[path[-1]] != -1:
        path.append(parents[path[-1]])
    return path[::-1]
