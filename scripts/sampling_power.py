"""False-alarm rate and power of the sampling (distribution) tests; NOT run in CI.

    python scripts/sampling_power.py [--seeds 200]

For every CI distribution-test setup (same draw counts as CI) this prints one Markdown table row:

- false alarms: the fraction of seeds on which the check of tests/stattest.py fails when the counts are a
  multinomial sample of the EXACT distribution of correct code (the enumerated AR joint, or the closed form),
  at the CI alpha (tests.stattest.ALPHA) and at alpha = 0.01 (calibration: about 1% is expected there);
- power: the fraction of seeds on which the check fails when the counts are a multinomial sample of the
  EXACT distribution a buggy verifier induces, computed by recursion over the tree (or the chain) on the
  table model of tests/core/test_verify.py. Bugs:
  tree (i)   sibling retry zeroes r[x] after a rejection but does not renormalise r (later siblings are
             accepted with p[x] instead of p[x] / (1 - sum of tried p)); the bonus is drawn from r (normalised
             by the sampler, so the residual itself is right);
  tree (ii)  after rejecting every candidate the bonus is drawn from p instead of the residual;
  chain (i)  the correction after a rejection is drawn from p instead of norm((p - q)+);
  chain (ii) at full acceptance the bonus is drawn from the last draft's row p[g-1] instead of p[g].
A test that checks several distributions (several trees, rules or sampling settings) fails when any check
fails; the rates are per test. Loop-level setups (tiny random Llamas through the engine loop) get the
false-alarm rate only: their buggy distributions depend on drafter state and randomness, and each loop run
costs tens of milliseconds, so their power is shown by the CI negative controls (tests/stattest.check_loop).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: ``tests`` is a package

from tests.stattest import ALPHA, chisquare_binned  # noqa: E402
from tests.core.test_verify import ACCEPT_LENGTH_DRAWS, V, TableModel, dup_tree, random_tree  # noqa: E402


# ---- exact distributions on the table model -----------------------------------------------------------

def _np(t) -> np.ndarray:
    return t.numpy().astype(float)


def complete(model: TableModel, committed: tuple, mass: float, out: dict, length: int = 3) -> None:
    """Add ``mass`` x P(AR completion of ``committed`` to ``length`` tokens) to ``out`` (truncating)."""
    if len(committed) >= length:
        key = committed[:length]
        out[key] = out.get(key, 0.0) + mass
        return
    p = _np(model.p[committed])
    for t in range(V):
        if p[t] > 0:
            complete(model, committed + (t,), mass * p[t], out, length)


def tree_step(model: TableModel, tree, bug: str | None) -> tuple[dict, dict]:
    """Exact (committed tokens -> prob, accept length -> prob) of one sibling-retry step on ``tree``."""
    toks, kids = tree.tokens.tolist(), tree.children
    committed: dict = {}
    lengths: dict = {}

    def visit(node: int, path: tuple, mass: float) -> None:
        p = _np(model.p[path])
        stay, r, tried = mass, p.copy(), set()
        for c in kids[node]:
            x = toks[c]
            if x in tried:
                continue
            tried.add(x)
            gate = r[x]
            visit(c, path + (x,), stay * gate)
            stay *= 1.0 - gate
            r[x] = 0.0
            if bug != "no-renorm" and r.sum() > 0:
                r = r / r.sum()
        bonus = p if (bug == "bonus-from-p" and kids[node]) or r.sum() <= 0 else r / r.sum()
        lengths[len(path)] = lengths.get(len(path), 0.0) + stay
        for t in range(V):
            if bonus[t] > 0:
                committed[path + (t,)] = committed.get(path + (t,), 0.0) + stay * bonus[t]

    visit(0, (), 1.0)
    return committed, lengths


def tree_joint(model: TableModel, tree, bug: str | None) -> dict:
    committed, _ = tree_step(model, tree, bug)
    out: dict = {}
    for c, m in committed.items():
        complete(model, c, m, out)
    return out


def chain_joint(model: TableModel, g: int, bug: str | None) -> dict:
    """Exact joint of 3 tokens: chain speculative sampling of ``g`` drafts from q, then AR completion."""
    out: dict = {}

    def step(prefix: tuple, i: int, mass: float) -> None:
        p, q = _np(model.p[prefix]), _np(model.q[prefix])
        if i == g:
            row = _np(model.p[prefix[:-1]]) if bug == "bonus-row" else p
            for t in range(V):
                complete(model, prefix + (t,), mass * row[t], out)
            return
        acc = np.minimum(1.0, np.divide(p, q, out=np.ones_like(p), where=q > 0))
        reject = float((q * (1 - acc)).sum())
        for x in range(V):
            if q[x] * acc[x] > 0:
                step(prefix + (x,), i + 1, mass * q[x] * acc[x])
        if reject > 1e-15:
            res = np.maximum(p - q, 0.0)
            corr = p if bug == "correction-from-p" else res / res.sum()
            for t in range(V):
                complete(model, prefix + (t,), mass * reject * corr[t], out)

    step((), 0, 1.0)
    return out


# ---- the Monte Carlo over test outcomes ----------------------------------------------------------------

def flagged(exact: dict, truth: dict, n: int, rng: np.random.Generator, alpha: float) -> bool:
    """Draw counts ~ Multinomial(n, truth) and apply the check against ``exact``; True when it fails."""
    keys = sorted(set(exact) | set(truth))
    e = np.array([exact.get(k, 0.0) for k in keys])
    t = np.array([truth.get(k, 0.0) for k in keys])
    counts = rng.multinomial(n, t / t.sum())
    if (counts[e <= 0] > 0).any():
        return True
    pos = e > 0
    return chisquare_binned(counts[pos].astype(float), e[pos] / e[pos].sum() * n).pvalue < alpha


def rate(checks: list, seeds: int, alpha: float, base_seed: int) -> float:
    """``checks``: (exact, truth, n) per check of one test; the test fails when any check fails."""
    hits = 0
    for s in range(seeds):
        rng = np.random.default_rng([base_seed, s])
        hits += any(flagged(e, t, n, rng, alpha) for e, t, n in checks)
    return hits / seeds


# ---- the CI setups -------------------------------------------------------------------------------------

def table_setups() -> list:
    """(test, draws, null checks, {bug: checks or None}) for the table-model tests of tests/core/test_verify.py."""
    rows = []
    m1 = TableModel(seed=1)
    ar1 = m1.ar_joint()
    tree = dup_tree()
    # Bug (i) lives in the sibling-retry form only (sample-then-match has no renormalisation step): it is "n/a"
    # for tests that run sample_tree alone, and in a test running both forms it affects one of the two checks.
    for rule in ("sample-then-match", "sibling-retry"):
        rows.append((f"test_verify::test_tree_sampling_reproduces_ar_joint[{rule}]", "30,000",
                     [(ar1, ar1, 30_000)],
                     {"tree (i) no renormalise": [(ar1, tree_joint(m1, tree, "no-renorm"), 30_000)]
                      if rule == "sibling-retry" else None,
                      "tree (ii) bonus from p": [(ar1, tree_joint(m1, tree, "bonus-from-p"), 30_000)]}))
    m3 = TableModel(seed=3)
    ar3 = m3.ar_joint()
    rng = np.random.default_rng(5)
    trees = [random_tree(rng, w=int(rng.integers(4, 12))) for _ in range(3)]
    rows.append(("test_verify::test_tree_sampling_random_trees", "3 x 15,000", [(ar3, ar3, 15_000)] * 3,
                 {"tree (i) no renormalise": None,  # the test runs sample_tree only
                  "tree (ii) bonus from p": [(ar3, tree_joint(m3, t, "bonus-from-p"), 15_000) for t in trees]}))
    m4 = TableModel(seed=4)
    _, exact_len = tree_step(m4, tree, None)
    _, bug_len = tree_step(m4, tree, "no-renorm")
    n_len = ACCEPT_LENGTH_DRAWS
    rows.append(("test_verify::test_both_tree_forms_have_the_exact_accept_length_distribution",
                 f"2 x {n_len:,}", [(exact_len, exact_len, n_len)] * 2,
                 {"tree (i) no renormalise": [(exact_len, exact_len, n_len), (exact_len, bug_len, n_len)],
                  "tree (ii) bonus from p": None}))  # the bonus does not change the accept length
    m6 = TableModel(seed=6)
    ar6 = m6.ar_joint()
    assert max(abs(ar6[k] - v) for k, v in chain_joint(m6, 2, None).items()) < 1e-12  # the recursion is exact
    rows.append(("test_verify::test_chain_sampling_reproduces_ar_joint", "30,000", [(ar6, ar6, 30_000)],
                 {"chain (i) correction from p": [(ar6, chain_joint(m6, 2, "correction-from-p"), 30_000)],
                  "chain (ii) bonus from row g-1": [(ar6, chain_joint(m6, 2, "bonus-row"), 30_000)]}))
    return rows


def loop_setups() -> list:
    """(test, draws, null checks) for the loop-level tests: exact AR joints of the tiny random Llamas."""
    import torch

    from specgraft.core.sampling import SamplingParams
    from tests.conftest import tiny_llama
    from tests.engine.test_engine import exact_ar_joint

    prompt, vocab = [1, 2, 3, 1, 2], 6
    params = SamplingParams(temperature=0.9, top_k=5)
    two = exact_ar_joint(tiny_llama(vocab=vocab, scale=3.0, seed=3), prompt, params, vocab)
    four = exact_ar_joint(tiny_llama(vocab=vocab, layers=4, scale=3.0, seed=3), prompt, params, vocab)
    rows = [("engine/test_engine::test_sampling_through_the_loop_matches_ar_enumeration[correct]", "2 x 5,000",
             [(two, two, 5000)] * 2),
            ("drafters/test_draft_model::test_chain_sampling_through_the_loop_matches_ar[correct]", "5,000",
             [(two, two, 5000)]),
            ("graft/test_drafter::test_graft_tree_sampling_through_the_loop_matches_ar[correct]", "5,000",
             [(four, four, 5000)]),
            ("graft/test_drafter::test_tail_chain_sampling_matches_ar[correct]", "5,000", [(two, two, 5000)]),
            ("eagle/test_head::test_eagle_sampling_through_the_loop_matches_ar[correct]", "5,000",
             [(four, four, 5000)])]
    sharp = tiny_llama(vocab=vocab, scale=8.0, seed=3)
    trunc = []
    for p in (SamplingParams(0.9, min_p=0.3), SamplingParams(0.9, eta=0.3)):
        e: dict = {}
        for k, v in exact_ar_joint(sharp, prompt, p, vocab).items():
            e[k[:2]] = e.get(k[:2], 0.0) + v
        trunc.append((e, e, 1000))
    rows.append(("lossy/test_rules::test_lossless_sd_under_truncation_sampling_matches_ar_truncation_sampling[correct]",
                 "2 x 1,000", trunc))
    del torch
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=200, help="simulated CI runs per cell (default 200)")
    args = ap.parse_args()
    t0 = time.time()
    S = args.seeds
    print(f"CI alpha = {ALPHA:g}; {S} seeds per cell; counts are multinomial samples of exact distributions "
          "(correct code: the enumerated AR joint / closed form; bugs: exact recursion over the tree or chain "
          "on the table model).\n")
    print("| test | draws | false alarms @ alpha=1e-4 | false alarms @ alpha=0.01 | power: bug | power |")
    print("|---|---|---|---|---|---|")
    for i, (name, draws, null, bugs) in enumerate(table_setups()):
        fa, fa01 = rate(null, S, ALPHA, 10 * i), rate(null, S, 0.01, 10 * i)
        first = True
        for bug, checks in bugs.items():
            power = "n/a (the bug cannot occur in, or does not change, what this test checks)" if checks is None else \
                f"{rate(checks, S, ALPHA, 10 * i + 1 + len(bug)):.3f}"
            lead = f"| {name} | {draws} | {fa:.3f} | {fa01:.3f}" if first else "| | | |"
            print(f"{lead} | {bug} | {power} |")
            first = False
    for i, (name, draws, null) in enumerate(loop_setups()):
        fa, fa01 = rate(null, S, ALPHA, 100 + i), rate(null, S, 0.01, 100 + i)
        print(f"| {name} | {draws} | {fa:.3f} | {fa01:.3f} | broken verifier (softmax without sampling settings + residual dropped) | "
              "shown by the [broken-verifier] test, not simulated |")
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
