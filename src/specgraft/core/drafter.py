"""The drafter protocol: every method, AR included, is a drafter that the one engine loop drives.

The engine keeps one prototype per method and options and gives every request its own :meth:`Drafter.fork`
(sharing weights, and retrieval state only where the method's scope says so). Per request it calls
``start`` once (after prefill), then per step ``propose`` (a tree within the node budget) and ``observe``
(the target's logits at every node of that tree, and the verdict). Retrieval state (Token Recycling's and
Graft's matrix) lives behind ``observe``; the loop never knows which drafter it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .sampling import SamplingParams
from .tree import Tree
from .verify import Verdict


@dataclass(frozen=True)
class DraftContext:
    ids: list[int]  # committed tokens, prompt included; ids[-1] is the root of the next tree
    budget: int  # maximum number of non-root nodes the tree may have
    sampling: SamplingParams = SamplingParams()  # a drafter that samples must use the same processing


def last_occurrences(ids: list[int]) -> list[int]:
    """Positions of the last occurrence of each distinct token, ascending (the last position is always one)."""
    return sorted({t: i for i, t in enumerate(ids)}.values())


class Drafter(Protocol):
    name: str
    # Whether ``start`` wants prefill logits: the rows at the last occurrence of each distinct prompt token
    # (``last_occurrences``; all an adjacency matrix keeps), not every position, because an
    # lm_head over a long prompt's every position costs as much as a large part of the prefill.
    needs_prefill_logits: bool

    # Target hidden-state layers the drafter reads at prefill and at every verified node (EAGLE heads).
    hidden_layers: tuple[int, ...]
    # Seconds spent in the drafter's own model forwards (EAGLE head, draft model): the engine separates them
    # from host-side work when it measures a step.
    forward_s: float

    def fork(self) -> "Drafter":
        """A fresh drafter for one request: same weights and settings, its own per-request state."""
        ...

    def start(self, prompt_ids: list[int], prefill_logits: torch.Tensor | None,
              prefill_hidden: dict[int, torch.Tensor] | None = None) -> None: ...

    def propose(self, ctx: DraftContext) -> Tree: ...

    def observe(self, tree: Tree, logits: torch.Tensor, verdict: Verdict,
                hidden: dict[int, torch.Tensor] | None = None) -> None: ...

    def describe(self) -> dict:
        """Configuration and state for records: method parameters, retrieval scope and state."""
        ...


class NoDraft:
    """Plain autoregressive decoding: the tree is the root alone, so each step commits one token."""

    name = "ar"
    needs_prefill_logits = False
    hidden_layers = ()
    forward_s = 0.0

    def fork(self) -> "NoDraft":
        return self

    def start(self, prompt_ids, prefill_logits, prefill_hidden=None) -> None:
        pass

    def propose(self, ctx: DraftContext) -> Tree:
        return Tree.chain(ctx.ids[-1], [])

    def observe(self, tree, logits, verdict, hidden=None) -> None:
        pass

    def describe(self) -> dict:
        return {"method": self.name}
