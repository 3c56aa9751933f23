"""Draft-model drafter on tiny random models: greedy equality, chain sampling in distribution, vocab check."""

import pytest
import torch

from specgraft.backend import TargetBackend
from specgraft.drafters import make_drafter
from specgraft.errors import SpecgraftError
from specgraft.sampling import SamplingParams

from .conftest import tiny_llama
from .test_decode import exact_ar_joint, run, sample_counts
from .test_verify import assert_matches


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


def test_chain_sampling_through_the_loop_matches_ar():
    vocab = 6
    target = tiny_llama(vocab=vocab, scale=3.0, seed=3)
    params = SamplingParams(temperature=0.9, top_k=5, seed=0)
    prompt = [1, 2, 3, 1, 2]
    exact = exact_ar_joint(target, prompt, params, vocab)
    backend = TargetBackend(target)
    drafter = make_drafter("draft", vocab, model=tiny_llama(vocab=vocab, scale=3.0, seed=11))
    n = 5000
    counts = sample_counts(backend, drafter, prompt, params, 3, n)
    assert_matches(counts, exact, n, "draft chain")


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
    """The level-by-level tree forward in the draft's own cache gives the same log-probs as plain forwards."""
    from specgraft.drafters.base import DraftContext

    draft = tiny_llama(vocab=16, scale=2.0, seed=2)
    drafter = make_drafter("draft", 16, model=draft, shape="tree", top_k=2, depth=2)
    prompt = [1, 5, 7, 3]
    drafter.start(prompt, None)
    prompt = prompt + [9]  # the root: committed, not yet in any cache
    tree = drafter.propose(DraftContext(prompt, 6))
    assert tree.size == 7
    toks = tree.tokens.tolist()
    with torch.no_grad():
        for i in range(1, tree.size):  # each node must be among its parent's top-2 continuations
            path, n = [], tree.parent_list[i]
            while n != 0:
                path.append(toks[n])
                n = tree.parent_list[n]
            logits = draft(input_ids=torch.tensor([prompt + path[::-1]])).logits[0, -1]
            assert toks[i] in torch.topk(logits, 2).indices.tolist(), i
