"""Prompt lookup decoding: copy the continuation of an earlier occurrence of the current n-gram suffix.

Example (``max_ngram=3``, ``num_pred=4``)::

    ids   = a b c d e f a b c   (suffix "a b c")
    match = positions 0..2 -> candidates = ids[3:7] = d e f a

Longest n-gram first, earliest match first; the continuation may be cut by the end of the history.
The candidates form a deterministic chain verified like any tree.

In our words, with the worked examples the tests assert: docs/design.md §4.1.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..core.tree import SOURCE_CONTEXT, Tree
from ..core.drafter import DraftContext


def pld_candidates(ids: np.ndarray, max_ngram: int = 3, num_pred: int = 10) -> list[int]:
    t = len(ids)
    for n in range(min(max_ngram, t - 1), 0, -1):
        tail = ids[t - n:]
        windows = sliding_window_view(ids[: t - 1], n)  # windows that end before the last token
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return ids[start: min(start + num_pred, t)].tolist()
    return []


class PromptLookup:
    """The number of predicted tokens is the loop's node budget (default 10)."""

    name = "pld"
    needs_prefill_logits = False
    hidden_layers = ()
    forward_s = 0.0

    def __init__(self, max_ngram: int = 3):
        if not isinstance(max_ngram, int) or max_ngram < 1:
            raise ValueError(f"pld needs an integer max_ngram >= 1, got {max_ngram!r}")
        self.max_ngram = max_ngram

    def fork(self) -> "PromptLookup":
        return self  # stateless: the context is all it reads

    def start(self, prompt_ids, prefill_logits, prefill_hidden=None) -> None:
        pass

    def propose(self, ctx: DraftContext) -> Tree:
        n = ctx.budget
        cands = pld_candidates(np.asarray(ctx.ids), self.max_ngram, n) if n > 0 else []
        return Tree.chain(ctx.ids[-1], cands, SOURCE_CONTEXT)

    def observe(self, tree, logits, verdict, hidden=None) -> None:
        pass

    def describe(self) -> dict:
        return {"method": self.name, "max_ngram": self.max_ngram}
