"""Graft's context source: golden tests of the matches, the estimates, the trie, the slot split and the merge
(docs/design.md §5.10), then the drafter on tiny models: greedy equality with AR on repetitive prompts and
sampling through the loop against exact AR enumeration (with a negative control)."""

import numpy as np
import pytest
import torch

from specgraft.core.backend import TargetBackend
from specgraft.core.sampling import SamplingParams
from specgraft.core.tree import SOURCE_CONTEXT, SOURCE_DRAFT, SOURCE_RETRIEVAL, SOURCE_ROOT
from specgraft.graft.context import (BUCKETS, MIN_TRIALS, PRIOR_STRENGTH, ContextModel, Match, bucket, context_trie,
                                     find_matches, fit_context, request_factor, split_slots, take_trie)
from specgraft.graft.drafter import GraftDrafter
from specgraft.graft.pruning import SparseGate
from specgraft.graft.templates import graft_merge
from specgraft.registry import make_drafter

from ..conftest import tiny_llama
from ..eagle.test_head import random_head
from ..stattest import N_NEGATIVE, check_loop, with_negative_control
from ..engine.test_engine import SAMPLING_PARAMS, SAMPLING_PROMPT, SAMPLING_VOCAB, run, sample_counts, sampling_problem


def test_find_matches_golden():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13
    ids = [5, 1, 2, 3, 4, 9, 1, 2, 3, 7, 8, 1, 2, 3]  # suffix "1 2 3" occurs at 1 and 6
    got = find_matches(ids, max_ngram=3)
    # both hits match 3 tokens (5 != 8, 9 != 8 one further back): most recent first; continuations to the end
    assert got == [Match(9, 3, (7, 8, 1, 2, 3)), Match(4, 3, (4, 9, 1, 2, 3, 7, 8, 1, 2, 3))]
    # a longer backward match wins over recency: "8 1 2 3" matched at 0..3 (length 4) beats the later hit
    ids2 = [8, 1, 2, 3, 6, 0, 1, 2, 3, 7, 8, 1, 2, 3]
    assert [(m.start, m.length) for m in find_matches(ids2)] == [(4, 4), (9, 3)]
    assert find_matches(ids, max_chains=1, depth=2) == [Match(9, 3, (7, 8))]
    assert find_matches([1, 2, 3, 4, 5]) == []  # nothing repeats
    assert find_matches([4, 6, 4], max_ngram=3) == [Match(1, 1, (6, 4))]  # falls back to n = 1
    # equal continuations are offered once (the first, i.e. the better, one)
    assert [m.tokens for m in find_matches([1, 2, 1, 2, 1, 2], max_ngram=1)] == [(1, 2), (1, 2, 1, 2)]


def test_buckets_values_and_factor():
    assert [bucket(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 40)] == [0, 1, 2, 3, 3, 4, 4, 5, 5]
    model = ContextModel(((0.5, 0.4, 0.1),) * len(BUCKETS), "test")
    assert model.values(Match(0, 2, (1, 2, 3, 4))) == [0.5, 0.4, 0.1, 0.1]  # beyond the table: its last depth
    assert model.values(Match(0, 2, (1, 2)), factor=3.0) == [0.999, 0.999]  # capped below 1
    assert model.values(Match(0, 2, (1, 2)), factor=0.5) == [0.25, 0.2]
    assert request_factor(0, 0) == 1.0
    assert request_factor(6, 2) == pytest.approx((6 + PRIOR_STRENGTH) / (2 + PRIOR_STRENGTH))
    prior = ContextModel.prior()
    assert all(a >= b for row in prior.table for a, b in zip(row, row[1:]))
    assert [row[0] for row in prior.table] == sorted(row[0] for row in prior.table)  # longer match, higher


def test_trie_split_and_take_golden():
    a = Match(0, 3, (7, 8, 9))
    b = Match(0, 1, (7, 6))
    tokens, parents, vals = context_trie([a, b], [[0.6, 0.5, 0.4], [0.3, 0.2]])
    #  root ── 7 (.6) ── 8 (.5) ── 9 (.4)
    #            └────── 6 (.2)                   the shared 7 keeps the better estimate
    assert (tokens, parents, vals) == ([7, 8, 9, 6], [0, 1, 2, 1], [0.6, 0.5, 0.4, 0.2])
    # matrix template estimates .55 .15 .07: the 4 best of both are .6 .55 .5 .4 -> 3 go to the context
    assert split_slots(vals, [0.55, 0.15, 0.07], 4) == 3
    assert split_slots(vals, [0.6, 0.15], 1) == 0  # a tie goes to the matrix (the paper's source)
    assert split_slots(vals, [], 10) == 4
    assert take_trie(tokens, parents, vals, 3) == [1, 2, 3]
    assert take_trie(tokens, parents, [0.6, 0.1, 0.05, 0.2], 2) == [1, 4]


def test_merge_of_both_sources_golden():
    """draft root->a(1)->b(2); context chain a b c d takes 2 slots (a, b merge into the draft: no slot), then the
    matrix fills the rest under the same root."""
    tokens, parents = [0, 1, 2], [-1, 0, 1]
    source = [SOURCE_ROOT, SOURCE_DRAFT, SOURCE_DRAFT]
    ctx = graft_merge(tokens, parents, [0, 1, 2, 3, 4], np.array([-1, 0, 1, 2, 3]), 2, 5, "merge",
                      source_retrieval=SOURCE_CONTEXT, source=source)
    assert ctx.tokens == [0, 1, 2, 3, 4] and ctx.parents == [-1, 0, 1, 2, 3]
    assert ctx.source == [SOURCE_ROOT, SOURCE_DRAFT, SOURCE_DRAFT, SOURCE_CONTEXT, SOURCE_CONTEXT]
    assert (ctx.n_retrieved, ctx.n_dedup, ctx.added_from) == (2, 2, [3, 4])
    mat = graft_merge(ctx.tokens, ctx.parents, [0, 5, 1], np.array([-1, 0, 0]), 1, 3, "merge", source=ctx.source)
    assert mat.tokens == [0, 1, 2, 3, 4, 5] and mat.parents[-1] == 0
    assert mat.source[-1] == SOURCE_RETRIEVAL and mat.source[:5] == ctx.source


def test_fit_context_measures_acceptance_per_bucket_and_depth():
    # a prompt that the "output" copies exactly: after a few tokens every chain is right to the end
    prompt = list(range(100, 160))
    seq = prompt + prompt[:60]
    fit = fit_context([(seq, len(prompt))])
    table, trials, hits = np.array(fit["table"]), np.array(fit["trials"]), np.array(fit["hits"])
    assert fit["positions"] == 59 and (hits <= trials).all()
    assert trials.sum() > 0 and (table <= 1).all() and (np.diff(table, axis=1) <= 1e-12).all()
    top = BUCKETS.index(16)
    assert trials[top, 0] >= MIN_TRIALS and table[top, 0] == 1.0  # long matches that copy: all accepted
    prior = ContextModel.prior().table
    assert table[0].tolist() == [round(x, 4) for x in np.minimum.accumulate(prior[0])]  # unobserved: the prior
    # worked by hand: prompt 1 2 3 4 9 9, output 1 2 3 7; positions 7, 8, 9 (root = the last committed token)
    small = fit_context([([1, 2, 3, 4, 9, 9, 1, 2, 3, 7], 6)])
    assert small["positions"] == 3
    # t=7: "1" (n=1) -> 2 3 4 ..., truth 2 3 7: 2 right of 3 checkable; t=8: "1 2" -> 3 4 ..., truth 3 7: 1 of 2;
    # t=9: "1 2 3" -> 4 ..., truth 7: 0 of 1
    assert [row[:3] for row in small["trials"][:3]] == [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
    assert [row[:3] for row in small["hits"][:3]] == [[1, 1, 0], [1, 0, 0], [0, 0, 0]]


def _unsure_graft(target, vocab, **kw):
    head = random_head(target, list(range(vocab)), seed=3)
    with torch.no_grad():
        head.lm_head.weight.div_(20)  # an unsure head: the level-0 gate always fires, most slots are freed
    inner = make_drafter("eagle", vocab, target=target, head=head, top_k=3, depth=4)
    return GraftDrafter(inner, vocab, "graft", SparseGate((0.99, 0.99, 0.99)), **kw)


def test_context_candidates_are_offered_accepted_and_exact_greedy():
    target = tiny_llama(vocab=16, layers=4, scale=4.0)
    backend = TargetBackend(target)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9, 2, 6, 3, 1]  # a repeated span: lookups match
    ref, _ = run(backend, make_drafter("ar", 16), prompt, SamplingParams(), 48, 0)
    on, off = _unsure_graft(target, 16), _unsure_graft(target, 16, context=False)
    out_on, st_on = run(backend, on, prompt, SamplingParams(), 48, 12)
    out_off, st_off = run(backend, off, prompt, SamplingParams(), 48, 12)
    assert out_on == ref and out_off == ref
    c = on.describe()["counters"]
    assert c["offered_context"] > 0 and c["accepted_context"] > 0, c
    assert off.describe()["counters"].get("offered_context", 0) == 0 and off.describe()["context"] is None
    assert on.describe()["context"] == {"on": True, "model": "prior", "ngram": 3, "chains": 4}
    assert "context" not in on.describe()["stage_histogram"]  # no calibration: the head is never skipped
    # A head expected to accept nothing: every step with a match skips the expansion; still exact
    first = _unsure_graft(target, 16, head_expected=[0.0] * 64)
    budgets = []  # what the head was asked to draft each step (0 = take in the accepted tokens, no expansion)
    real_draft = first.inner.draft_steps  # Graft drafts through its inner drafter's steps
    first.inner.draft_steps = lambda ctx, gate=None: budgets.append(ctx.budget) or real_draft(ctx, gate)
    out_first, st_first = run(backend, first, prompt, SamplingParams(), 48, 12)
    assert out_first == ref
    hist = first.describe()["stage_histogram"]
    assert hist.get("context", 0) > 0 and budgets.count(0) == hist["context"], (hist, budgets)


@pytest.mark.parametrize("kind", ["draft-tree", "draft-chain"])
def test_context_on_draft_model_trees_and_tail_chains_equals_ar(kind):
    target = tiny_llama(vocab=16, scale=4.0)
    backend = TargetBackend(target)
    prompt = [2, 7, 1, 8, 2, 8, 1, 8, 2, 7, 1, 8, 2, 8]
    ref, _ = run(backend, make_drafter("ar", 16), prompt, SamplingParams(), 40, 0)
    draft = tiny_llama(vocab=16, scale=4.0, seed=5)
    d = make_drafter("graft", 16, target=target, drafter=kind, model=draft, top_k=3, depth=4, calibration="none")
    if kind == "draft-chain":  # estimates above the matrix's rank-0 prior: a context tail wherever one exists
        d = GraftDrafter(d.inner, 16, "tail", context_model=ContextModel(((0.9,) * 4,) * len(BUCKETS), "test"))
    out, _ = run(backend, d, prompt, SamplingParams(), 40, 8)
    assert out == ref and d.context
    assert d.lifetime_context > 0


@with_negative_control
def test_context_tree_sampling_through_the_loop_matches_ar(broken, monkeypatch):
    vocab, prompt, params = SAMPLING_VOCAB, SAMPLING_PROMPT, SAMPLING_PARAMS
    target, exact, backend = sampling_problem(4)
    # stage 0 every step: the context takes freed slots; a head expected to accept .5 tokens is skipped
    # whenever the best chain's estimates sum to as much (both tree paths are sampled)
    d = _unsure_graft(target, vocab, head_expected=[0.5] * 64)
    n = N_NEGATIVE if broken else 5000
    check_loop(monkeypatch, broken, lambda n: sample_counts(backend, d, prompt, params, 6, n), exact, n,
               "graft tree with context")
    assert d.lifetime_context > n / 4  # context nodes were in play
    if not broken:
        assert n / 10 < d.lifetime_context_first < n  # both paths: head skipped, and head drafted


@with_negative_control
def test_context_tail_sampling_matches_ar(broken, monkeypatch):
    vocab, prompt, params = SAMPLING_VOCAB, SAMPLING_PROMPT, SAMPLING_PARAMS
    target, exact, backend = sampling_problem()
    inner = make_drafter("draft", vocab, model=tiny_llama(vocab=vocab, scale=3.0, seed=11))
    # context estimates above the matrix's rank 0: the tail is a context continuation whenever one exists
    model = ContextModel(((0.9,) * 4,) * len(BUCKETS), "test")
    d = GraftDrafter(inner, vocab, "tail", tau_tail=0.3, context_model=model)
    n = N_NEGATIVE if broken else 5000
    check_loop(monkeypatch, broken, lambda n: sample_counts(backend, d, prompt, params, 4, n), exact, n,
               "graft-tail chain with context")
    assert d.lifetime_context > n / 4


def test_bad_context_options_are_refused():
    from specgraft.errors import SpecgraftError

    target = tiny_llama(vocab=16, layers=4)
    head = random_head(target, list(range(16)))
    for opts, msg in (({"context": "maybe"}, "on or off"), ({"ctx_ngram": 0}, "ctx_ngram"),
                      ({"ctx_chains": "x"}, "ctx_chains")):
        with pytest.raises(SpecgraftError, match=msg):
            make_drafter("graft", 16, target=target, head=head, calibration="none", **opts)
