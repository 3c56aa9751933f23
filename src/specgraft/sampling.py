"""Sampling parameters and the one logits-processing function that AR and every verifier share.

"Lossless" means "equal to AR decoding with the same settings": the target distribution ``p`` that a
verification rule sees at a tree node is exactly what AR would sample from at that position.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .errors import SpecgraftError


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise SpecgraftError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise SpecgraftError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpecgraftError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise SpecgraftError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise SpecgraftError(f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[..., V]`` logits -> float32 probabilities after temperature, top-k, then top-p (HF order).

    Under greedy decoding this is not used: rules take ``argmax`` of the raw logits.
    """
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop_sorted = (cum - sorted_x.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else torch.seed())
    return g
