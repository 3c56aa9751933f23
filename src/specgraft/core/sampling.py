"""Sampling parameters and the one logits-processing function that AR and every verifier share.

"Lossless" means "equal to AR decoding with the same settings": the target distribution ``p`` that a
verification rule sees at a tree node is exactly what AR would sample from at that position.

In our words, with the worked examples the tests assert: docs/design.md §3.3.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..errors import SpecgraftError


# Truncation-sampling settings: part of the target distribution a lossless method must match, and the
# parameters the lossy rules' correct baselines use.
TRUNCATION_KEYS = ("min_p", "eta")
MIN_TEMPERATURE = 1e-5  # below it (but > 0) logits / temperature overflow float32 to inf: greedy is what is meant
SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed's range


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy. ``top_k == 0``, ``top_p == 1``, ``min_p == 0`` and ``eta == 0``
    disable those filters. ``min_p`` / ``eta`` are truncation *sampling* (HF's min-p and eta warpers): the
    correct quality baselines of the lossy truncation rules; speculative decoding stays lossless w.r.t. them."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    eta: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise SpecgraftError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise SpecgraftError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise SpecgraftError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g} (smaller ones "
                                 f"overflow the scaled logits), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpecgraftError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise SpecgraftError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed <= SEED_MAX):
            raise SpecgraftError(f"seed must be an integer in [0, 2^63 - 1], got {self.seed!r}")
        for name in TRUNCATION_KEYS:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
                raise SpecgraftError(f"{name} must be in [0, 1] (0 = off), got {v!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[..., V]`` logits -> float32 probabilities after temperature, top-k, top-p, min-p, then eta (HF order).

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
        # ...explicitly: a top_p below float32's smallest value (5e-324, found by the server's fuzzer) rounds to 0
        # in the comparison and would drop every token, leaving NaN probabilities
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    if params.min_p > 0:
        p = x.softmax(-1)
        x = x.masked_fill(p < params.min_p * p.amax(-1, keepdim=True), float("-inf"))
    if params.eta > 0:
        p = x.softmax(-1)
        ent = -(p * p.clamp(min=1e-30).log()).sum(-1, keepdim=True)
        thr = torch.minimum(torch.full_like(ent, params.eta), math.sqrt(params.eta) * torch.exp(-ent))
        drop = (p < thr) & (p < p.amax(-1, keepdim=True))  # the argmax always stays
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else torch.seed())
    return g
