"""The one statistical check used by every sampling (distribution) test.

Rule, for observed ``counts`` of ``n`` draws against an exact distribution ``expected``:

1. an outcome with expected probability 0 must never occur (a hard failure, whatever the counts);
2. cells are sorted by expected count, ascending, and consecutive cells are merged into bins until each bin
   has expected count >= ``MIN_EXPECTED`` (5); a leftover partial bin at the end merges into its neighbour;
3. Pearson's chi-square on the bins (``scipy.stats.chisquare``, ``bins - 1`` degrees of freedom) must have
   p-value >= ``ALPHA``.

``ALPHA = 1e-4`` is the false-alarm rate of one call on correct code (the chi-square approximation is good
once every bin expects >= 5; ``scripts/sampling_power.py`` measures the real rate and the power of each test
against realistic verifier bugs). There is deliberately no per-cell z bound: on cells that expect far below
one count a single draw is a huge z, so such a bound fails correct code at a rate far above its nominal one.

In our words, with the worked examples the tests assert: docs/design.md §7.2.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from scipy import stats as sps

ALPHA = 1e-4  # false-alarm rate of one check on correct code (per call, not per cell)
MIN_EXPECTED = 5.0  # smallest expected count of a bin


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    pvalue: float
    dof: int
    bins: int
    n: int
    impossible: tuple  # outcomes that occurred although their expected probability is 0

    def passed(self, alpha: float = ALPHA) -> bool:
        return not self.impossible and self.pvalue >= alpha


def pool(exp: np.ndarray, min_expected: float = MIN_EXPECTED) -> np.ndarray:
    """Bin index of each cell: ascending expected count, consecutive cells merged until a bin expects
    >= ``min_expected``; a leftover partial bin joins the bin before it (the neighbour in that order)."""
    order = np.argsort(exp, kind="stable")
    label = np.empty(len(exp), dtype=np.int64)
    b, acc, start = 0, 0.0, 0
    for j, i in enumerate(order):
        label[i] = b
        acc += exp[i]
        if acc >= min_expected:
            b, acc, start = b + 1, 0.0, j + 1
    if start < len(order) and b > 0:  # leftover cells below min_expected: merge into the previous bin
        label[order[start:]] = b - 1
    return label


def pooled_chisquare(counts: dict, expected: dict, n: int | None = None) -> ChiSquare:
    """The test statistic and p-value of the rule above (no assertion). ``expected`` maps outcome to
    probability (renormalised over its positive cells); ``n`` defaults to the total count."""
    total = int(round(sum(counts.values())))
    n = total if n is None else int(n)
    assert total == n, f"counts add up to {total}, not n={n}"
    impossible = tuple(k for k, c in counts.items() if c and expected.get(k, 0.0) <= 0.0)
    keys = [k for k, v in expected.items() if v > 0]
    prob = np.array([expected[k] for k in keys], dtype=float)
    mass = prob.sum()
    assert abs(mass - 1.0) < 1e-3, f"expected probabilities add up to {mass}, not 1"
    exp = prob / mass * n
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    return chisquare_binned(obs, exp, impossible)


def chisquare_binned(obs: np.ndarray, exp: np.ndarray, impossible: tuple = ()) -> ChiSquare:
    """Pooled Pearson chi-square for aligned arrays of observed and expected counts (positive cells only)."""
    label = pool(exp)
    nb = int(label.max()) + 1 if len(label) else 0
    obs_b = np.bincount(label, weights=obs, minlength=nb)
    exp_b = np.bincount(label, weights=exp, minlength=nb)
    n = int(round(obs.sum()))
    if nb < 2:  # one bin: nothing to compare beyond the impossible outcomes
        return ChiSquare(0.0, 1.0, 0, nb, n, impossible)
    exp_b = exp_b * (obs_b.sum() / exp_b.sum())  # equal totals, as chisquare requires (rounding only)
    res = sps.chisquare(obs_b, exp_b)
    return ChiSquare(float(res.statistic), float(res.pvalue), nb - 1, nb, n, impossible)


def cells(vec) -> dict:
    """A vector of counts or probabilities over tokens as the ``{token: value}`` dict the checks take."""
    return {i: float(v) for i, v in enumerate(vec.tolist() if hasattr(vec, "tolist") else vec)}


def assert_matches(counts: dict, expected: dict, n: int, label: str = "", alpha: float = ALPHA) -> ChiSquare:
    """Fail when an impossible outcome occurred or the pooled chi-square p-value is below ``alpha``."""
    res = pooled_chisquare(counts, expected, n)
    assert not res.impossible, f"{label}: outcomes with probability 0 occurred: {list(res.impossible)[:5]}"
    assert res.pvalue >= alpha, (f"{label}: pooled chi-square {res.statistic:.1f} on {res.dof} dof, "
                                 f"p={res.pvalue:.2e} < alpha={alpha:g} (n={n})")
    return res


# ---- negative controls for loop-level sampling tests ----------------------------------------------------

# Parametrises a loop-level test over (correct verifier, broken verifier); the test calls check_loop.
with_negative_control = pytest.mark.parametrize("broken", [False, True], ids=["correct", "broken-verifier"])
N_NEGATIVE = 300  # draws of a negative control: the broken rule is far off, so few draws fail it

def broken_verify_tree(tree, logits, params, gen):
    """``verify_tree`` with two realistic slips: the sampling settings are not threaded into the verifier
    (``p`` is the plain softmax of the logits: temperature 1, no top-k / min-p / eta), and after a rejection
    the token is drawn from ``p`` instead of the residual (chains: instead of ``norm((p - q)+)``; trees:
    instead of ``p`` restricted to the untried tokens). Either slip alone is a distribution change of a few
    percent that the loop tests' 5,000 draws catch; together they fail the check within ``N_NEGATIVE``
    draws, which keeps the negative controls cheap. Greedy calls are passed through unchanged."""
    import torch

    from specgraft.core.verify import Verdict, sample_chain, sample_tree, verify_tree

    if params.greedy:
        return verify_tree(tree, logits, params, gen)
    probs = torch.softmax(logits.double(), -1)
    if tree.draft_probs is not None and tree.size > 1:
        n_acc, nxt = sample_chain(tree.tokens[1:], probs, tree.draft_probs[1:], gen)
        if n_acc < tree.size - 1:  # rejected: the correction should come from the residual
            nxt = int(torch.multinomial(probs[n_acc], 1, generator=gen))
        return Verdict(list(range(n_acc + 1)), nxt)
    v = sample_tree(tree, probs, gen)
    last = v.accepted[-1]
    if tree.children[last]:  # stopped after rejecting candidates: the bonus should avoid them
        return Verdict(v.accepted, int(torch.multinomial(probs[last], 1, generator=gen)))
    return v


def check_loop(monkeypatch, broken: bool, sample, expected: dict, n: int, label: str = ""):
    """One loop-level distribution check: ``sample(n)`` returns the counts of ``n`` runs through the engine
    loop. ``broken=False``: they must match ``expected``. ``broken=True`` (the negative control): the loop's
    verifier is replaced by :func:`broken_verify_tree`, and the same check must fail."""
    if not broken:
        return assert_matches(sample(n), expected, n, label)
    import specgraft.request

    monkeypatch.setattr(specgraft.request, "verify_tree", broken_verify_tree)
    res = pooled_chisquare(sample(n), expected, n)  # the check itself must fail, not some other assertion
    assert not res.passed(), f"{label}: the broken verifier passed (p={res.pvalue:.2e}): the test has no power"
    return res
