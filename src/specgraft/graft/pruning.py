"""Pruning policies: gates that stop a dynamic draft tree's expansion early (``dynamic_tree.expand_topk``).

Each gate is called after every draft level ``l`` (0 = the root's children) with the frontier's cumulative
log-probs ``S_l`` and the log-prob row the best frontier node was drawn from; ``True`` stops drafting there.

=========  ==================================================  =========================================
policy     statistic                                           stops when (checked at)
=========  ==================================================  =========================================
echo       ``c_l = exp(max S_l)`` (best path probability)      ``c_l < tau_l``   (levels 0, 1, 5)
ddd        ``H_l = logsumexp(S_l)`` (beam mass, log)           ``H_l < log 0.2`` (levels 2, 4, 6, 8)
svip       ``sqrt(entropy(q))`` of the best node's draft row   ``> 0.8`` nats^1/2 (every level)
=========  ==================================================  =========================================

``echo`` is also Graft's gate: the level that fires picks the *stage* (index in the checkpoints), which sets
how many draft nodes are kept and how many retrieval slots are filled (:func:`specgraft.graft.templates.stage_split`).

In our words, with the worked examples the tests assert: docs/design.md §5.2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

CHECKPOINTS = (0, 1, 5)
FALLBACK_THRESHOLDS = (0.35, 0.25, 0.15)  # used when no calibration exists (a third-party guess, see docs)


@dataclass(frozen=True)
class SparseGate:
    """ECHO-style sparse checkpoint gating; ``stage_of(level)`` maps a firing level to Graft's stage."""

    thresholds: tuple[float, ...] = FALLBACK_THRESHOLDS
    checkpoints: tuple[int, ...] = CHECKPOINTS
    name: str = field(default="echo", compare=False)

    def __post_init__(self) -> None:
        if len(self.thresholds) != len(self.checkpoints) or not all(0 <= t <= 1 for t in self.thresholds):
            raise ValueError(f"echo needs one threshold in [0, 1] per checkpoint {self.checkpoints}, "
                             f"got {self.thresholds}")

    def __call__(self, level: int, scores: torch.Tensor, logp: torch.Tensor) -> bool:
        if level not in self.checkpoints:
            return False
        return math.exp(float(scores.max())) < self.thresholds[self.checkpoints.index(level)]

    def stage_of(self, level: int | None) -> int | None:
        return None if level is None else self.checkpoints.index(level)

    def stage_from_confidences(self, level_best: list[float]) -> int | None:
        """The stage a full-depth draft *would* have stopped at (Graft's ``batch`` variant drafts to full depth)."""
        for s, (lvl, tau) in enumerate(zip(self.checkpoints, self.thresholds)):
            if lvl < len(level_best) and level_best[lvl] < tau:
                return s
        return None


@dataclass(frozen=True)
class DDD:
    """Dynamic Depth Decoding: stop when the beam's total probability mass falls below ``exp(h_thr)``."""

    h_thr: float = math.log(0.2)
    levels: tuple[int, ...] = (2, 4, 6, 8)
    name: str = field(default="ddd", compare=False)

    def __call__(self, level: int, scores: torch.Tensor, logp: torch.Tensor) -> bool:
        return level in self.levels and float(torch.logsumexp(scores.float(), 0)) < self.h_thr


@dataclass(frozen=True)
class SVIP:
    """Stop at the first level whose best node was drawn from a high-entropy draft distribution."""

    h: float = 0.8
    name: str = field(default="svip", compare=False)

    def __call__(self, level: int, scores: torch.Tensor, logp: torch.Tensor) -> bool:
        logp = logp.float()
        entropy = float(-(logp.exp() * logp).nan_to_num().sum())
        return math.sqrt(max(entropy, 0.0)) > self.h


def make_policy(name: str, thresholds: tuple[float, ...] | None = None, param: float | None = None):
    """``echo`` (thresholds from calibration), ``ddd`` (``param`` = log-mass threshold), ``svip`` (``param`` = h)."""
    if name == "echo":
        return SparseGate(tuple(thresholds) if thresholds is not None else FALLBACK_THRESHOLDS)
    if name == "ddd":
        return DDD() if param is None else DDD(h_thr=float(param))
    if name == "svip":
        return SVIP() if param is None else SVIP(h=float(param))
    raise ValueError(f"unknown pruning policy '{name}'; choose echo, ddd or svip")
