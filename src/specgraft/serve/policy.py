"""The scheduler's budget policy: smaller trees as the batch grows (docs/serving.md, "Budget under load").

One batched forward verifies every request's tree, so its cost grows with the batch's total tree slots. On a
memory-bound CPU a forward over a few tokens costs about as much as over one, then grows; a budget that is best
alone (B = 1) overpays at B = 4 and loses to AR at B = 8 (docs/benchmarks.md, issue 13's batch table). For each
step with B >= 2 requests, each request's budget becomes

    K*(B) = argmax_{0 <= K <= budget}  B * MAT(K) / (B * draft_s [0 at K = 0 for EAGLE heads] + verify_s(B * (K + 1)))

with ``verify_s`` this machine's measured latency curve (``costs.py``, every width 1..64; proportional to the
width beyond) taken as measured, not smoothed: llama.cpp's x86 GEMM runs on blocks of 4 rows, so a 3-row
forward can cost more than a 4-row one, and the argmax then lands the batch's trees on the end of a cheap block) read at the batch's total slots and
``MAT(K)`` replayed from the method's calibration (eagle / graft / prune), as ``--budget auto`` does for one
request. Methods without a calibration (pld, recycle, draft) keep their trees inside the curve's cheap region:
``K = min(budget, knee // B - 1)``, ``knee`` the widest forward costing at most 25% more than one token.
Alone (B = 1) a request keeps its own budget. Only the candidates change, so every output stays lossless.
Sampled requests keep their budget too: a different tree consumes a request's random stream differently, so
shrinking it would make a seeded request's text depend on what runs beside it (still correctly distributed,
but not reproducible); greedy outputs do not depend on the tree at all.
"""

from __future__ import annotations

from ..auto import draft_share
from ..costs import interpolate, latency_curve
from ..graft.calibration import expected_mat
from ..registry import find_calibration

CALIBRATED = ("eagle", "graft", "prune")


def knee(curve: dict[int, float], slack: float = 1.25) -> int:
    base = curve[min(curve)]
    return max(w for w, s in curve.items() if s <= slack * base)


def verify_s(curve: dict[int, float], width: int) -> float:
    """Interpolated inside the measured widths; beyond them proportional to the width (compute-bound)."""
    top = max(curve)
    return interpolate(curve, width) if width <= top else curve[top] * width / top


def batch_budget(curve: dict[int, float], ranks: list[list[int]], draft_s: float, budget: int, batch: int,
                 idle_at_zero: bool = False) -> int:
    """K*(B) of the module docstring. ``idle_at_zero``: the drafter does no work at K = 0 (an EAGLE head defers
    the accepted tokens' features to its next drafting step), so K = 0 costs AR's step in the model (Graft's host
    work on the verified logits still runs: serve/runner.py sheds such requests to AR); otherwise its time is
    paid at every K and shrinking the budget is never credited with a saving it does not make. ``B * draft_s``
    is an upper bound where drafting is batched across requests (the head's passes are): the policy errs
    towards smaller trees."""
    def rate(k: int) -> float:
        drafting = 0.0 if (k == 0 and idle_at_zero) else batch * draft_s
        return batch * expected_mat(ranks, k) / (drafting + verify_s(curve, batch * (k + 1)))

    return max(range(budget + 1), key=rate)


class BatchBudget:
    """``engine.budget_policy``: built once on an idle engine (measuring the latency curve if not cached)."""

    def __init__(self, engine):
        self.curve = latency_curve(engine)  # as measured: see the module docstring
        self.knee = knee(self.curve)
        self.model = engine.model_name
        self._cal: dict[tuple, tuple | None] = {}
        self._memo: dict[tuple, int] = {}

    def calibration(self, config: dict) -> tuple | None:
        """(accepted ranks, draft seconds per step, idle at K = 0) of a request's method, or None without a
        calibration."""
        method = config.get("method")
        if method not in CALIBRATED:
            return None
        key = (method, config.get("drafter"), config.get("calibration"), config.get("head"))
        if key not in self._cal:
            try:
                opts = {k: v for k, v in config.items() if k in ("drafter", "calibration", "head")}
                opts.setdefault("drafter", "eagle")
                cal, _ = find_calibration(opts, self.model, required=True)
                draft_s = cal.draft_s * draft_share(method, opts["drafter"], cal)
                idle = opts["drafter"] == "eagle"  # the head skips budget-0 steps (eagle/drafter.py, DEFER_MAX)
                self._cal[key] = (cal.accepted_ranks, draft_s, idle) if cal.accepted_ranks else None
            except Exception:  # noqa: BLE001 -- no usable calibration: fall back to the knee rule
                self._cal[key] = None
        return self._cal[key]

    def __call__(self, req, batch: int) -> int:
        if not req.params.greedy:  # see the module docstring: seeded sampling stays reproducible
            return req.budget
        return self.budget_for(req.config, req.budget, batch)

    def budget_for(self, config: dict, budget: int, batch: int) -> int:
        """K*(batch) for a greedy request of ``config``'s method (its ``method`` and drafter options) asking for
        ``budget``: what a step of ``batch`` requests gives it."""
        if batch < 2:
            return budget
        cal = self.calibration(config)
        key = (id(cal[0]) if cal else None, budget, batch)
        if key not in self._memo:
            self._memo[key] = batch_budget(self.curve, *cal[:2], budget, batch, *cal[2:]) if cal else \
                max(0, min(budget, self.knee // batch - 1))
        return self._memo[key]
