"""Graft and pruning drafters on tiny random models: greedy equality for every variant, the budget bound,
hybrid trees really verified, and sampling through the loop (Graft trees and Graft-TAIL chains) equal to AR."""

import pytest
import torch

from specgraft.core.backend import TargetBackend
from specgraft.registry import make_drafter
from specgraft.graft.drafter import GraftDrafter
from specgraft.errors import SpecgraftError
from specgraft.graft.pruning import SparseGate
from specgraft.core.sampling import SamplingParams

from ..conftest import tiny_llama
from ..stattest import N_NEGATIVE, check_loop, with_negative_control
from ..engine.test_engine import (SAMPLING_PARAMS, SAMPLING_PROMPT, SAMPLING_VOCAB, run, sample_counts,
                           sampling_problem)
from ..eagle.test_head import random_head


class _Sizes:
    """Pass-through drafter that records tree sizes and source mixes."""

    forward_s = 0.0

    def __init__(self, inner):
        self.inner, self.sizes, self.retrieved = inner, [], 0
        self.name, self.needs_prefill_logits = inner.name, inner.needs_prefill_logits
        self.hidden_layers = inner.hidden_layers

    def start(self, *a):
        self.inner.start(*a)

    def propose(self, ctx):
        tree = self.inner.propose(ctx)
        self.sizes.append(tree.size - 1)
        self.retrieved += int((tree.source == 2).sum())
        return tree

    def observe(self, *a):
        self.inner.observe(*a)

    def describe(self):
        return self.inner.describe()


VARIANTS = [("graft", {}), ("graft", {"variant": "fixed"}), ("graft", {"variant": "root"}),
            ("graft", {"variant": "batch"}), ("graft", {"dedup": "skip"}), ("graft", {"scope": "global"}),
            ("prune", {"policy": "echo"}), ("prune", {"policy": "ddd"}), ("prune", {"policy": "svip"})]


@pytest.mark.parametrize("inner", ["eagle", "draft-tree"])
def test_every_variant_equals_ar_greedy_within_budget(inner):
    target = tiny_llama(vocab=16, layers=4, scale=4.0)
    backend = TargetBackend(target)
    extra = ({"head": random_head(target, [0, 1, 2, 3, 5, 8, 13, 15]), "top_k": 3, "depth": 6} if inner == "eagle"
             else {"model": tiny_llama(vocab=16, scale=4.0, seed=5), "top_k": 3, "depth": 6})
    for prompt in ([1, 2, 3, 4], [9, 9, 2, 7, 7])[: 1 if inner == "eagle" else 2]:  # eagle drafting is slower
        ref, _ = run(backend, make_drafter("ar", 16), prompt, SamplingParams(), 40, 0)
        for method, opts in VARIANTS:
            d = make_drafter(method, 16, target=target, drafter=inner, calibration="none", **extra, **opts)
            rec = _Sizes(d)
            out, st = run(backend, rec, prompt, SamplingParams(), 40, 12)
            assert out == ref, (inner, method, opts, prompt)
            assert max(rec.sizes) <= 12
            if method == "graft" and opts.get("variant") in ("fixed", "root"):
                assert rec.retrieved > 0  # the matrix is warm after the prefill: slots are really filled
            if method == "prune":
                assert rec.retrieved == 0


def test_graft_offers_retrieval_and_counts_it():
    target = tiny_llama(vocab=16, layers=4, scale=4.0)
    backend = TargetBackend(target)
    head = random_head(target, list(range(16)), seed=3)
    with torch.no_grad():
        head.lm_head.weight.div_(20)  # an unsure head: the level-0 gate always fires
    inner = make_drafter("eagle", 16, target=target, head=head, top_k=3, depth=6)
    d = GraftDrafter(inner, 16, "graft", SparseGate((0.99, 0.99, 0.99)))  # always stage 0: 2 draft + retrieval
    run(backend, d, [1, 2, 3, 4, 1, 2, 3, 4], SamplingParams(), 40, 12)
    info = d.describe()
    assert info["stage_histogram"] == {"0": sum(info["stage_histogram"].values())}
    c = info["counters"]
    assert c["offered_retrieval"] > c["offered_draft"] > 0 and c["accepted_retrieval"] > 0
    assert 0 < info["retrieval_hit_rate"] <= 1 and info["rows_filled"] > 0


def test_tail_fills_the_chain_from_the_matrix_and_equals_ar():
    target = tiny_llama(vocab=16, scale=4.0)
    backend = TargetBackend(target)
    draft = tiny_llama(vocab=16, scale=4.0, seed=5)
    ref, _ = run(backend, make_drafter("ar", 16), [1, 2, 3, 4], SamplingParams(), 40, 0)
    inner = make_drafter("draft", 16, model=draft, shape="chain")
    d = GraftDrafter(inner, 16, "graft", tau_tail=0.9)  # chain => Graft-TAIL; a strict tau keeps short prefixes
    rec = _Sizes(d)
    out, st = run(backend, rec, [1, 2, 3, 4], SamplingParams(), 40, 6)
    assert out == ref and d.variant == "tail"
    assert rec.retrieved > 0 and max(rec.sizes) <= 6
    with pytest.raises(ValueError, match="not available for a chain"):
        GraftDrafter(inner, 16, "fixed")


@with_negative_control
def test_graft_tree_sampling_through_the_loop_matches_ar(broken, monkeypatch):
    vocab, prompt, params = SAMPLING_VOCAB, SAMPLING_PROMPT, SAMPLING_PARAMS
    target, exact, backend = sampling_problem(4)
    inner = make_drafter("eagle", vocab, target=target, head=random_head(target, [0, 1, 2, 4], seed=4), top_k=2,
                         depth=3)
    d = GraftDrafter(inner, vocab, "graft", SparseGate((0.9, 0.9, 0.9)))  # hybrid trees at every step
    n = N_NEGATIVE if broken else 5000
    check_loop(monkeypatch, broken, lambda n: sample_counts(backend, d, prompt, params, 6, n), exact, n,
               "graft tree")
    assert d.lifetime_retrieval > n / 10  # retrieved nodes were in play (vocab 6: many merge into drafts)


@with_negative_control
def test_tail_chain_sampling_matches_ar(broken, monkeypatch):
    vocab, prompt, params = SAMPLING_VOCAB, SAMPLING_PROMPT, SAMPLING_PARAMS
    target, exact, backend = sampling_problem()
    inner = make_drafter("draft", vocab, model=tiny_llama(vocab=vocab, scale=3.0, seed=11))
    # A loose tau keeps 1-3 sampled draft tokens, then a one-hot retrieved tail: the stop must not look at
    # the token it would draw (a rule that did made P(first token) .42 instead of .30 in a two-token example).
    d = GraftDrafter(inner, vocab, "tail", tau_tail=0.3)
    n = N_NEGATIVE if broken else 5000
    check_loop(monkeypatch, broken, lambda n: sample_counts(backend, d, prompt, params, 4, n), exact, n,
               "graft-tail chain")
    assert d.lifetime_retrieval > n / 2


def test_bad_options_are_refused():
    target = tiny_llama(vocab=16, layers=4)
    head = random_head(target, list(range(16)))
    for opts, msg in (({"variant": "tail"}, "not available for a tree"), ({"drafter": "x"}, "unknown drafter"),
                      ({"scope": "x"}, "scope"), ({"dedup": "x"}, "dedup"), ({"dedup": "none"}, "unreachable"),
                      ({"calibration": "/nonexistent"}, "no calibration")):
        with pytest.raises(SpecgraftError, match=msg):
            make_drafter("graft", 16, target=target, head=head, **opts)
    with pytest.raises(SpecgraftError, match="unknown pruning policy"):
        make_drafter("prune", 16, target=target, head=head, policy="x", calibration="none")
