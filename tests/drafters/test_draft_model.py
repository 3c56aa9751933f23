"""Draft-model drafter on tiny random models: greedy equality, chain sampling in distribution, vocab check."""

import pytest
import torch

from specgraft.core.backend import TargetBackend
from specgraft.registry import make_drafter
from specgraft.errors import SpecgraftError
from specgraft.core.sampling import SamplingParams

from ..conftest import tiny_llama
from ..stattest import N_NEGATIVE, check_loop, with_negative_control
from ..engine.test_engine import (SAMPLING_PARAMS, SAMPLING_PROMPT, SAMPLING_VOCAB, run, sample_counts,
                           sampling_problem)


def test_greedy_equality_and_acceptance():
    target = tiny_llama(vocab=16, scale=4.0, seed=0)
    backend = TargetBackend(target)
    for draft_model, expect_all in ((tiny_llama(vocab=16, scale=4.0, seed=0), True),  # draft == target
                                    (tiny_llama(vocab=16, scale=4.0, seed=5), False)):
        drafter = make_drafter("draft", 16, model=draft_model)
        for prompt in ([1, 2, 3, 4], [9, 9, 2]):
            ref, _ = run(backend, make_drafter("ar", 16), prompt, SamplingParams(), 40, 0)
            out, st = run(backend, drafter, prompt, SamplingParams(), 40, 4)
            assert out == ref
            if expect_all:  # an identical draft is always right: every step commits gamma + 1 tokens
                assert st.committed[:-1] == [5] * (len(st.committed) - 1)


@with_negative_control
def test_chain_sampling_through_the_loop_matches_ar(broken, monkeypatch):
    vocab, prompt, params = SAMPLING_VOCAB, SAMPLING_PROMPT, SAMPLING_PARAMS
    target, exact, backend = sampling_problem()
    drafter = make_drafter("draft", vocab, model=tiny_llama(vocab=vocab, scale=3.0, seed=11))
    check_loop(monkeypatch, broken, lambda n: sample_counts(backend, drafter, prompt, params, 3, n), exact,
               N_NEGATIVE if broken else 5000, "draft chain")


def test_vocab_mismatch_is_refused():
    with pytest.raises(SpecgraftError, match="vocabulary of 32 tokens but the target has 16"):
        make_drafter("draft", 16, model=tiny_llama(vocab=32))


def test_draft_tree_greedy_equality_and_budget():
    target = tiny_llama(vocab=16, scale=4.0, seed=0)
    backend = TargetBackend(target)
    for seed, budget in ((0, 12), (5, 30)):
        drafter = make_drafter("draft", 16, model=tiny_llama(vocab=16, scale=4.0, seed=seed), shape="tree",
                               top_k=3, depth=4)
        ref, _ = run(backend, make_drafter("ar", 16), [1, 2, 3, 4], SamplingParams(), 40, 0)
        out, st = run(backend, drafter, [1, 2, 3, 4], SamplingParams(), 40, budget)
        assert out == ref
        assert st.tree_nodes <= budget * st.steps
        if seed == 0:  # the draft is the target: its top-1 path is always accepted
            assert min(st.committed[:-1]) >= 2 and st.mat > 2.5


def test_draft_tree_matches_sequential_draft_logits():
    """The level-by-level tree forward in the draft's own cache gives the same log-probs as plain forwards:
    every candidate's cumulative score equals the sum of sequential log-softmax values along its path (a node
    fed one position too far shifts RoPE and fails this by far more than float tolerance)."""
    from specgraft.core.drafter import DraftContext

    draft = tiny_llama(vocab=16, scale=2.0, seed=2)
    drafter = make_drafter("draft", 16, model=draft, shape="tree", top_k=2, depth=3)
    prompt = [1, 5, 7, 3]
    drafter.start(prompt, None)
    prompt = prompt + [9]  # the root: committed, not yet in any cache
    cands = drafter.draft(DraftContext(prompt, 6))
    assert len(cands.tokens) == 2 + 3 * 4  # top-2 at level 0, then 2 x 2 per expanded level
    err = 0.0
    with torch.no_grad():
        for i in range(len(cands.tokens)):
            path, n = [], i
            while n != -1:
                path.append(cands.tokens[n])
                n = cands.parents[n]
            path.reverse()
            seq = 0.0
            for j, tok in enumerate(path):
                logits = draft(input_ids=torch.tensor([prompt + path[:j]])).logits[0, -1]
                seq += float(torch.log_softmax(logits.float(), -1)[tok])
            err = max(err, abs(cands.scores[i] - seq))
    assert err < 1e-5, err  # fixed: ~2e-7; fed one position too far: ~8e-4
    assert drafter.backend.prefix_len == len(prompt)  # the speculation was dropped from the draft's cache


def test_chain_stop_statistic_is_the_one_the_runtime_compares():
    """Under sampling, the statistic returned for token i (what calibration fits tau_tail on) is
    ``prod_{j<i} q_j(y_j) * max q_i``, known before y_i is drawn - not the drawn token's cumulative q."""
    from specgraft.core.drafter import DraftContext
    from specgraft.core.sampling import target_probs

    draft = tiny_llama(vocab=16, scale=1.0, seed=2)  # flat: the drawn token is rarely the argmax
    params = SamplingParams(temperature=1.0, seed=3)
    drafter = make_drafter("draft", 16, model=draft)
    prompt = [1, 5, 7, 3]
    drafter.start(prompt, None)
    ctx = DraftContext(prompt + [9], 6, params)
    drafts, _, stats = drafter.chain(ctx, 5)
    c, want = 1.0, []
    with torch.no_grad():
        for i, x in enumerate(drafts):
            q = target_probs(draft(input_ids=torch.tensor([ctx.ids + drafts[:i]])).logits[0, -1], params)
            want.append(c * float(q.max()))
            c *= float(q[x])
    assert len(stats) == len(drafts) == 5
    assert max(abs(a - b) for a, b in zip(stats, want)) < 1e-5, (stats, want)
