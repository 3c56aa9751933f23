"""Token Recycling (arXiv 2408.08696): an adjacency matrix of top-k successors, read through a static tree.

``M[v]`` holds the top-k tokens the target predicted the last time it processed token ``v`` (``-1`` = never
seen). Every verification overwrites the rows of every tree node's token (accepted or not) with the top-k
of that node's logits. A template of rank paths turns ``M`` into a tree, one batched gather per level::

    root r                    rank path      token
    ├── M[r,0] = a            [0]            a
    │   ├── M[a,0]            [0,0]          M[a, 0]
    │   └── M[a,1]            [0,1]          M[a, 1]
    └── M[r,1] = b            [1]            b
        └── M[b,0]            [1,0]          M[b, 0]

A node whose parent's row is empty is dropped with its subtree.

In our words, with the worked examples the tests assert: docs/design.md §4.2.
"""

from __future__ import annotations

import copy

import torch

from ..core.drafter import DraftContext
from ..core.tree import Tree
from .matrix import AdjacencyMatrix, compile_template

# The official "2.2.2" template (80 nodes, depth 6), as rank paths from the root, level by level.
TEMPLATE_222: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,),
    (0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (0, 7), (1, 0), (1, 1), (1, 2), (1, 3),
    (2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (4, 0), (5, 0), (6, 0), (7, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 0, 4), (0, 0, 5), (0, 0, 6), (0, 0, 7), (0, 1, 0),
    (0, 1, 1), (0, 1, 2), (0, 2, 0), (0, 2, 1), (0, 3, 0), (0, 4, 0), (0, 5, 0), (0, 6, 0), (0, 7, 0),
    (1, 0, 0), (1, 0, 1), (1, 1, 0), (2, 0, 0), (3, 0, 0), (4, 0, 0), (5, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 3), (0, 0, 0, 4), (0, 0, 1, 0), (0, 0, 1, 1),
    (0, 0, 2, 0), (0, 0, 3, 0), (0, 0, 4, 0), (0, 1, 0, 0), (0, 2, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0),
    (3, 0, 0, 0),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 0, 2), (0, 0, 0, 1, 0), (0, 0, 0, 2, 0), (0, 0, 1, 0, 0),
    (0, 1, 0, 0, 0), (1, 0, 0, 0, 0),
    (0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 1), (0, 0, 0, 1, 0, 0),
)


class TokenRecycling:
    """``scope="cold"``: the matrix is cleared for every request; ``"hot"``: it carries over."""

    name = "recycle"
    needs_prefill_logits = True
    _idle = False
    hidden_layers = ()
    forward_s = 0.0

    def __init__(self, vocab_size: int, k: int = 8, scope: str = "cold",
                 template: tuple[tuple[int, ...], ...] = TEMPLATE_222):
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"recycle k must be an integer >= 1, got {k!r}")
        if scope not in ("cold", "hot"):
            raise ValueError(f"recycle scope must be 'cold' or 'hot', got {scope!r}")
        self.matrix = AdjacencyMatrix(vocab_size, k)
        self.scope = scope
        self.parents, self.ranks, self.depths = compile_template(template)
        self.shared = {"requests": 0}  # with scope "hot", forks share the matrix and this counter

    def fork(self) -> "TokenRecycling":
        c = copy.copy(self)
        if self.scope == "cold":
            c.matrix, c.shared = AdjacencyMatrix(self.matrix.table.shape[0], self.matrix.k), {"requests": 0}
        return c

    def start(self, prompt_ids, prefill_logits, prefill_hidden=None) -> None:
        if self.scope == "cold":
            self.matrix.clear()
        self.shared["requests"] += 1
        # The prefill's logits are free successor observations for every distinct prompt token (None: the
        # request joined a batch too crowded to draft in and starts cold, engine._drafts_on_joining).
        if prefill_logits is not None:
            self.matrix.update_prompt(prompt_ids, prefill_logits)

    def propose(self, ctx: DraftContext) -> Tree:
        self._idle = ctx.budget <= 0  # the scheduler gave no tree: skip the observation's top-k (GraftDrafter)
        n = min(len(self.parents), ctx.budget + 1)
        return self.matrix.materialize(ctx.ids[-1], self.parents[:n], self.ranks[:n], self.depths[:n])

    def observe(self, tree: Tree, logits: torch.Tensor, verdict, hidden=None) -> None:
        if not self._idle:
            self.matrix.update(tree.tokens, logits)

    def describe(self) -> dict:
        state = "cold" if self.scope == "cold" or self.shared["requests"] <= 1 else "hot"
        return {"method": self.name, "k": self.matrix.k, "scope": self.scope, "retrieval_state": state,
                "template_nodes": len(self.parents) - 1, "rows_filled": self.matrix.rows_filled}
