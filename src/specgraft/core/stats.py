"""One statistics type for every method (the llama.cpp lesson: same counters and timings for all drafters).

Convention: a *step* is one target verification forward (prefill is not a step). ``committed[s]`` is the
number of tokens step ``s`` committed, i.e. accepted candidates + the bonus token, cut by EOS or
``max_new_tokens``. **MAT = mean(committed)** includes the bonus token, so AR decoding has MAT = 1; with
no step at all (a one-token request) it is undefined: NaN, written as null in records (docs/design.md §7).
``new_tokens`` also counts the first token, which comes from the prefill.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


def mean_accepted_tokens(committed: int | float, steps: int) -> float:
    """MAT: committed tokens per verification step (the bonus included); NaN when there was no step. Every
    MAT in the project (stats, reports, lossy tables) is this function."""
    return committed / steps if steps else math.nan


@dataclass
class Stats:
    method: str = "ar"
    steps: int = 0
    new_tokens: int = 0
    committed: list[int] = field(default_factory=list)
    tree_nodes: int = 0  # non-root candidates verified, summed over steps
    depth_trials: list[int] = field(default_factory=list)  # [d-1]: steps whose path reached depth d-1 with children
    depth_accepts: list[int] = field(default_factory=list)  # [d-1]: steps whose path reached depth d
    prefill_s: float = 0.0
    draft_s: float = 0.0  # propose + observe
    draft_forward_s: float = 0.0  # of which the drafter's own model forwards (EAGLE head, draft model)
    verify_s: float = 0.0  # the target forward over the tree(s)
    total_s: float = 0.0  # wall time of the whole request, prefill included
    retrieval_state: str | None = None  # cold / hot, for retrieval drafters
    verify: str = "lossless"  # or "lossy:RULE:PARAM" (opt-in; the output distribution is not the target's)

    @property
    def mat(self) -> float:
        return mean_accepted_tokens(sum(self.committed), len(self.committed))

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def acceptance_per_depth(self) -> list[float]:
        """alpha_d = P(a node at depth d is accepted | its parent was accepted and has children)."""
        return [a / t if t else 0.0 for a, t in zip(self.depth_accepts, self.depth_trials)]

    def record_step(self, reached_depth: int, deepest_with_children: list[bool], committed: int,
                    nodes: int) -> None:
        """``deepest_with_children[d]`` says whether the accepted node at depth d had children."""
        self.steps += 1
        self.committed.append(committed)
        self.tree_nodes += nodes
        need = max((d + 1 for d, k in enumerate(deepest_with_children) if k), default=0)
        for lst in (self.depth_trials, self.depth_accepts):
            lst.extend([0] * (need - len(lst)))
        for d, has_kids in enumerate(deepest_with_children):
            if has_kids:
                self.depth_trials[d] += 1
                if reached_depth > d:
                    self.depth_accepts[d] += 1

    def merge(self, other: "Stats") -> "Stats":
        """Sum of two runs of the same method (for per-dataset totals)."""
        out = Stats(self.method, verify=self.verify)
        for name in ("steps", "new_tokens", "tree_nodes", "prefill_s", "draft_s", "draft_forward_s", "verify_s",
                     "total_s"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.committed = self.committed + other.committed
        n = max(len(self.depth_trials), len(other.depth_trials))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        out.depth_trials = [a + b for a, b in zip(pad(self.depth_trials), pad(other.depth_trials))]
        out.depth_accepts = [a + b for a, b in zip(pad(self.depth_accepts), pad(other.depth_accepts))]
        out.retrieval_state = self.retrieval_state or other.retrieval_state
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(mat=None if math.isnan(self.mat) else round(self.mat, 4), tokens_per_s=round(self.tokens_per_s, 3), other_s=self.other_s,
                 acceptance_per_depth=[round(a, 4) for a in self.acceptance_per_depth],
                 mean_tree_nodes=self.tree_nodes / self.steps if self.steps else 0.0)
        return d

    def summary(self) -> str:
        state = f" retrieval={self.retrieval_state}" if self.retrieval_state else ""
        state += f" verify={self.verify} (LOSSY)" if self.verify != "lossless" else ""
        return (f"[{self.method}] {self.new_tokens} tokens in {self.total_s:.2f}s ({self.tokens_per_s:.1f} tok/s), "
                f"{self.steps} steps, MAT {self.mat:.2f} (incl. bonus), time draft {self.draft_s:.2f}s / "
                f"verify {self.verify_s:.2f}s / prefill {self.prefill_s:.2f}s / other {self.other_s:.2f}s{state}")
