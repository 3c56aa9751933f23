"""Graft calibration and matrix warm-up (`specgraft calibrate`).

Procedure (docs/graft.md): decode ``rounds`` warm-up prompts (ShareGPT, not the evaluation sets) greedily
with the *unpruned* tree (or full draft chain) and online matrix updates. Per step record

- tree drafters: at each checkpoint level ``d`` the confidence ``c_d`` (best cumulative path probability)
  and ``y_d`` = 1 if the accepted path holds a draft node deeper than level ``d`` (drafting past d paid off);
- chain drafters: for each drafted token ``j`` the runtime's stop statistic ``s_j = prod_{i<j} q_i(y_i) *
  max q_j`` (decided before ``y_j`` is drawn; see ``DraftModelDrafter.chain``) and whether it was accepted;
- the score rank of every accepted node (``autotune`` replays any smaller budget from them exactly);
- how often the target's next token sat at rank ``r`` of the matrix row (the templates' rank weights).

Then per checkpoint: 10 equal-mass bins of ``c``, their acceptance made monotone (pool-adjacent-violators),
``tau = `` the lower edge of the first bin whose rate reaches ``rho`` (default 0.5); under 200 observations
the fallback; clamped to [0.02, 0.9]. Optional ``extra`` conversations are read teacher-forced (one prefill
each, rows from every position): a cheap prior on CPU. The matrix after all of it is the warm-up snapshot.

In our words, with the worked examples the tests assert: docs/design.md §5.7.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..core.drafter import release
from ..core.tree import SOURCE_DRAFT, Tree
from ..drafters.dynamic_tree import InnerDrafter, rerank
from ..drafters.matrix import AdjacencyMatrix
from ..errors import SpecgraftError
from .pruning import CHECKPOINTS, FALLBACK_THRESHOLDS

MIN_OBS = 200
CLAMP = (0.02, 0.9)
FALLBACK_TAU_TAIL = 0.1


def expected_mat(accepted_ranks: list[list[int]], budget: int) -> float:
    """MAT of the dense tree at ``budget``, replayed from the score ranks of each step's accepted nodes."""
    return sum(1 + sum(r < budget for r in step) for step in accepted_ranks) / max(len(accepted_ranks), 1)


@dataclass
class Calibration:
    thresholds: tuple[float, ...] = FALLBACK_THRESHOLDS
    checkpoints: tuple[int, ...] = CHECKPOINTS
    tau_tail: float = FALLBACK_TAU_TAIL
    rank_weights: tuple[float, ...] | None = None
    meta: dict = field(default_factory=dict)
    snapshot: dict | None = None  # the warmed matrix ({"rows", "succ"})
    accepted_ranks: list[list[int]] = field(default_factory=list)  # per step (autotune)
    context: dict | None = None  # context retrieval's acceptance table (graft.context.fit_context)
    sequences: list[list[int]] = field(default_factory=list)  # the warm-up decodes: prompt length, then ids
    # further decodes the context table is fitted on (``calibrate --context-only --data``): each source's
    # settings (data, skip, rounds, max_new_tokens, backend, weights, date) and its ``sequences`` as above
    context_sources: list[dict] = field(default_factory=list)

    # -- what every budget decision reads (auto.py, ``--budget auto``, the server's policy) ---------------
    @property
    def draft_s(self) -> float:
        """Mean drafting seconds per step, measured during calibration (the full draft, ungated)."""
        return float(self.meta.get("draft_s_per_step", 0.0))

    @property
    def max_budget(self) -> int:
        """The largest budget the recorded ranks can replay."""
        return int(self.meta.get("budget", 60))

    def mat(self, budget: int) -> float:
        """Expected MAT of the dense tree at ``budget`` (``expected_mat`` over the recorded ranks)."""
        return expected_mat(self.accepted_ranks, budget)

    def thresholds_for(self, rho: float) -> tuple[float, ...]:
        """Re-read the stored monotone fits at another ``rho`` (no recalibration needed)."""
        fits = self.meta.get("fits", {})
        out = []
        for d, tau in zip(self.checkpoints, self.thresholds):
            f = fits.get(str(d), {})
            if "rate" not in f:
                out.append(tau)  # a fallback stays a fallback
                continue
            t = next((e for e, r in zip(f["bin_lower_edges"], f["rate"]) if r >= rho), CLAMP[1])
            out.append(min(max(t, CLAMP[0]), CLAMP[1]))
        return tuple(out)

    def head_expected(self, max_budget: int = 128) -> list[float] | None:
        """``[K]`` = the dense tree's expected accepted draft tokens per step at budget ``K``, replayed from the
        recorded score ranks of accepted nodes (as autotune does); None without them (chains record none)."""
        if not self.accepted_ranks:
            return None
        return [expected_mat(self.accepted_ranks, k) - 1 for k in range(max_budget + 1)]

    def provenance(self) -> dict:
        """What a record should say about this calibration: data, size, and where a threshold did not come
        from a fit (a fallback under ``MIN_OBS`` observations, or a clamp when no bin reached ``rho``). A chain
        calibration reports its ``tau_tail`` fit, a tree calibration its checkpoint fits."""
        m = self.meta
        fits, tail = m.get("fits", {}), m.get("tail_fit", {})
        rho = m.get("rho", 0.5)
        chain = m.get("drafter") == "draft-chain" or (tail.get("n", 0) > 0 and not any(f.get("n") for f in fits.values()))
        out = {"data": m.get("data", "unrecorded"), "skip": m.get("skip"), "rounds": m.get("rounds"),
               "extra_conversations": m.get("extra_conversations"), "max_new_tokens": m.get("max_new_tokens"),
               "budget": m.get("budget"), "date": m.get("date"), "rho": rho}
        chosen = {"tail": tail} if chain else fits
        out["observations"] = {d: f.get("n") for d, f in chosen.items()}
        out["fallback"] = [d for d, f in chosen.items() if "fallback" in f.get("rule", "fallback")]
        out["no_bin_reached_rho"] = [d for d, f in chosen.items() if f.get("rate") and max(f["rate"]) < rho]
        ctx = self.context or {}
        out["context"] = {"positions": ctx.get("positions"), "sequences": ctx.get("sequences"),
                          "first_token_by_bucket": [row[0] for row in ctx["table"]],
                          "cells_on_prior": sum(t < ctx["min_trials"] for row in ctx["trials"] for t in row),
                          "added_sources": [{k: v for k, v in src.items() if k != "sequences"}
                                            for src in self.context_sources]} \
            if "table" in ctx else "prior (no context table in this calibration)"
        return out

    def save(self, out: Path) -> None:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        body = {k: v for k, v in asdict(self).items() if k not in ("snapshot",)}
        tmp = out / "calibration.json.tmp"
        tmp.write_text(json.dumps(body, indent=1))
        if self.snapshot is not None:
            save_file({k: v.contiguous() for k, v in self.snapshot.items()}, str(out / "matrix.safetensors.tmp"))
            (out / "matrix.safetensors.tmp").replace(out / "matrix.safetensors")
        tmp.replace(out / "calibration.json")

    @staticmethod
    def load(path: Path) -> "Calibration":
        from safetensors.torch import load_file

        f = path / "calibration.json"
        if not f.exists():
            raise SpecgraftError(f"no calibration in {path} (run `specgraft calibrate`)")
        body = json.loads(f.read_text())
        cal = Calibration(tuple(body["thresholds"]), tuple(body["checkpoints"]), body["tau_tail"],
                          tuple(body["rank_weights"]) if body.get("rank_weights") else None, body.get("meta", {}),
                          None, body.get("accepted_ranks", []), body.get("context"), body.get("sequences", []),
                          body.get("context_sources", []))
        if (path / "matrix.safetensors").exists():
            cal.snapshot = load_file(str(path / "matrix.safetensors"))
        return cal


def below(fit: dict, tau: float) -> float:
    """Share of calibration steps whose checkpoint confidence fell below ``tau``, read from the fit's equal-mass
    bins (linear inside a bin; the last bin ends at 1). No fit: 0 (assume the gate never fires)."""
    edges = fit.get("bin_lower_edges") or []
    share = 0.0
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else 1.0
        if tau >= hi:
            share += 1
        elif tau > lo:
            share += (tau - lo) / (hi - lo)
    return share / len(edges) if edges else 0.0


def gate_pass_share(cal: "Calibration", depth: int) -> float:
    """Expected drafting passes under the calibrated gate / passes of the full draft (1 + depth).

    Confidences fall with depth, so "stopped by checkpoint i" is taken as nested: its probability is the
    largest ``below`` over checkpoints up to i."""
    fits = cal.meta.get("fits", {})
    stopped, passes = 0.0, 0.0
    for level, tau in zip(cal.checkpoints, cal.thresholds):
        if level >= depth:
            break
        now = max(stopped, below(fits.get(str(level), {}), tau))
        passes += (now - stopped) * (level + 1)
        stopped = now
    passes += (1 - stopped) * (depth + 1)
    return passes / (depth + 1)


def isotonic(y: list[float], w: list[float]) -> list[float]:
    """Pool-adjacent-violators: the non-decreasing fit of ``y`` with weights ``w``."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for yi, wi in zip(y, w):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    out: list[float] = []
    for m, _, c in blocks:
        out.extend([m] * c)
    return out


def fit_threshold(conf: list[float], outcome: list[int], rho: float = 0.5, fallback: float = 0.25,
                  bins: int = 10, min_obs: int = MIN_OBS) -> tuple[float, dict]:
    """``tau = min{c : g(c) >= rho}`` with ``g`` the monotone binned acceptance; see the module docstring."""
    if len(conf) < min_obs:
        return fallback, {"n": len(conf), "rule": f"fallback (< {min_obs} observations)"}
    pairs = sorted(zip(conf, outcome))
    edges, rates, weights = [], [], []
    for b in range(bins):
        part = pairs[b * len(pairs) // bins:(b + 1) * len(pairs) // bins]
        if part:
            edges.append(part[0][0])
            rates.append(sum(y for _, y in part) / len(part))
            weights.append(len(part))
    g = isotonic(rates, weights)
    tau = next((e for e, r in zip(edges, g) if r >= rho), CLAMP[1])
    tau = min(max(tau, CLAMP[0]), CLAMP[1])
    return tau, {"n": len(conf), "bin_lower_edges": [round(e, 4) for e in edges], "rate": [round(r, 3) for r in g],
                 "rule": f"first bin with monotone rate >= {rho}"}


class Recorder:
    """The unpruned drafter plus the matrix, recording what calibration and autotune need."""

    name = "calibrate"
    needs_prefill_logits = True

    def __init__(self, inner: InnerDrafter, matrix: AdjacencyMatrix):
        self.inner, self.matrix, self.chain = inner, matrix, inner.shape == "chain"
        self.hidden_layers = tuple(inner.hidden_layers)
        self.conf: dict = {d: [] for d in CHECKPOINTS}
        self.outcome: dict = {d: [] for d in CHECKPOINTS}
        self.tail_conf: list[float] = []
        self.tail_outcome: list[int] = []
        self.ranks: list[list[int]] = []
        self.rank_hits = [0] * matrix.k
        self.rank_trials = 0
        self._step: dict = {}

    @property
    def forward_s(self) -> float:
        return self.inner.forward_s

    def fork(self) -> "Recorder":
        return self  # one recorder accumulates over every calibration round

    def start(self, prompt_ids, prefill_logits, prefill_hidden=None) -> None:
        self.inner.start(prompt_ids, None, prefill_hidden)
        self.matrix.update_prompt(prompt_ids, prefill_logits)

    def propose(self, ctx):
        if self.chain:
            drafts, _, stop_stats = self.inner.chain(ctx, ctx.budget)
            self._step = {"stop_stats": stop_stats}  # the statistic the runtime stop compares with tau_tail
            return Tree.chain(ctx.ids[-1], drafts)
        cands = self.inner.draft(ctx, None)
        if cands is None:
            return Tree.chain(ctx.ids[-1], [])
        tokens, parents, kept = rerank(cands, ctx.budget)
        order = sorted(range(len(cands.tokens)), key=lambda i: (-cands.scores[i], i))
        rank = {c: r for r, c in enumerate(order)}
        self._step = {"level_best": cands.level_best, "ranks": [rank[c] for c in kept]}
        return Tree.build([ctx.ids[-1], *tokens], [-1, *parents], [0] + [SOURCE_DRAFT] * len(tokens))

    def release(self) -> None:
        release(self.inner)  # a draft model's row of its shared cache

    def observe(self, tree, logits, verdict, hidden=None) -> None:
        a = verdict.accept_length
        row = self.matrix.table[int(tree.tokens[0])]
        if int(row[0]) >= 0:  # how the target's next token ranks in the (pre-update) root row
            nxt = int(tree.tokens[verdict.accepted[1]]) if a else int(verdict.bonus)
            self.rank_trials += 1
            hit = (row == nxt).nonzero()
            if hit.numel():
                self.rank_hits[int(hit[0])] += 1
        if self.chain:
            for j, c in enumerate(self._step["stop_stats"]):
                if j == 0:
                    continue  # the runtime always keeps the first token: s_0 is never compared with tau_tail
                self.tail_conf.append(c)
                self.tail_outcome.append(int(a > j))
        else:
            best = self._step["level_best"]
            for d in CHECKPOINTS:
                if d < len(best):
                    self.conf[d].append(best[d])
                    self.outcome[d].append(int(a >= d + 2))
            self.ranks.append(sorted(self._step["ranks"][i - 1] for i in verdict.accepted[1:]))
        self.matrix.update(tree.tokens, logits)
        self.inner.observe(tree, logits, verdict, hidden)

    def describe(self) -> dict:
        return {"method": self.name}
