"""A request in flight, and what the engine checks before admitting one (docs/design.md §2).

``prepare`` validates everything and builds the :class:`Request` without running anything, so bad input fails
before a row is touched; admission then reserves the backend resources the request can hold at worst
(``Backend.reservation`` against ``Backend.capacity``), so a request that fits is never stopped mid-way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .core.drafter import Drafter
from .core.sampling import SamplingParams, target_probs
from .core.stats import Stats
from .core.tree import Tree
from .core.verify import Verdict, verify_tree
from .errors import SpecgraftError
from .lossy.rules import Rule
from .lossy.verify import verify_tree_lossy
from .text import TextState

VerifyFn = Callable[[Tree, torch.Tensor, SamplingParams, torch.Generator], Verdict]


class NoCapacity(SpecgraftError):
    """The request fits the model but not beside the requests in flight (KV cells, sequence ids): nothing was
    changed; admit it once some finish (the server keeps it queued). ``need``: what it reserves."""

    def __init__(self, message: str, need: dict[str, int]):
        super().__init__(message)
        self.need = need


@dataclass
class Request:
    id: int
    prompt_ids: list[int]
    drafter: Drafter
    params: SamplingParams
    max_new_tokens: int
    budget: int
    verify: VerifyFn
    stats: Stats
    config: dict
    detok: TextState | None  # incremental detokeniser and stop strings; None: a token-level request
    on_verify: Callable[[Tree, torch.Tensor], None] | None = None
    reserve: dict[str, int] = field(default_factory=dict)  # backend resources held while it runs
    gen: torch.Generator | None = None
    ids: list[int] = field(default_factory=list)  # prompt + output: ids[-1] is the next tree's root
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    admitted_at: float = 0.0  # clock() when its prefill began

    @property
    def room(self) -> int:
        return self.max_new_tokens - len(self.output)


def first_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """The token after the prompt, from the prefill logits (the same for every method)."""
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(target_probs(logits, params), 1, generator=gen))


def cut_at_eos(tokens: list[int], eos_ids: set[int], room: int) -> list[int]:
    """Tokens up to and including the first EOS, at most ``room`` of them."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
    return tokens[: min(end, room)]


def verify_fn(rule: Rule) -> VerifyFn:
    """The request's verification: lossless, or its opt-in LOSSY rule."""
    if not rule.lossy:
        return verify_tree
    return lambda tree, logits, params, gen: verify_tree_lossy(tree, logits, params, gen, rule)


def check_length(ids: list[int], max_new_tokens: int, budget: int, max_positions: int) -> None:
    if not ids:
        raise SpecgraftError("empty prompt")
    if len(ids) + max_new_tokens + budget + 1 > max_positions:
        raise SpecgraftError(f"prompt too long: {len(ids)} tokens + {max_new_tokens} new (+ {budget + 1} tree "
                             f"slots) exceeds the model's {max_positions} positions")


def check_reservation(reserve: dict[str, int], capacity: dict[str, int]) -> None:
    """Refuse a request that could not fit even alone (a 400, not a wait)."""
    over = {k: (v, cap) for k, v in reserve.items() if v > (cap := capacity.get(k, v))}
    if over:
        raise SpecgraftError("this request can never fit the backend: " + ", ".join(
            f"{k} {v} > {cap}" for k, (v, cap) in over.items()) + " (a smaller budget or max_new_tokens)")


def held(requests: list[Request]) -> dict[str, int]:
    """Backend resources held by ``requests`` (each holds its worst case from admission on)."""
    out: dict[str, int] = {}
    for r in requests:
        for k, v in r.reserve.items():
            out[k] = out.get(k, 0) + v
    return out


def fits(reserve: dict[str, int], holding: dict[str, int], capacity: dict[str, int]) -> bool:
    return all(holding.get(k, 0) + v <= capacity.get(k, holding.get(k, 0) + v) for k, v in reserve.items())
