"""EAGLE-3 head: TTT unroll == the drafting path, drafter greedy equality and sampling on tiny models."""

import torch

from specgraft.core.backend import TargetBackend
from specgraft.registry import make_drafter
from specgraft.eagle.head import Eagle3Head
from specgraft.eagle.checkpoint import config_for_target
from specgraft.core.sampling import SamplingParams
from specgraft.eagle.training.ttt import unroll

from ..conftest import tiny_llama
from ..stattest import N_NEGATIVE, check_loop, with_negative_control
from ..engine.test_engine import (SAMPLING_PARAMS, SAMPLING_PROMPT, SAMPLING_VOCAB, run, sample_counts,
                           sampling_problem)


def random_head(target, draft_ids, intermediate=48, seed=1) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(config_for_target(target.config, len(draft_ids), intermediate),
                      target.get_input_embeddings().weight.detach())
    head.set_vocab(torch.tensor(draft_ids))
    with torch.no_grad():  # sharper than default init, so that top-k choices are not near-ties
        head.lm_head.weight.mul_(20)
    return head.eval()


def test_vocab_maps():
    head = random_head(tiny_llama(vocab=16, layers=4), [1, 4, 5, 15])
    assert head.to_target(torch.tensor([0, 1, 2, 3])).tolist() == [1, 4, 5, 15]
    assert head.t2d.nonzero().flatten().tolist() == [1, 4, 5, 15]


def test_ttt_unroll_equals_drafting_a_chain():
    """Step i at position t must be the node i levels below a root whose last committed pair is t - i."""
    target = tiny_llama(vocab=16, layers=4)
    head = random_head(target, list(range(16)))
    T = 12
    torch.manual_seed(0)
    feats, ids = torch.randn(T, 3 * 32), torch.randint(0, 16, (T,))
    n = T - 1
    outs = unroll(head, feats[:n], ids[1:], steps=3)
    with torch.no_grad():
        for s in (0, 3, 7):
            h, past = head.step(head.fc(feats[: s + 1]).unsqueeze(0), ids[1 : s + 2].unsqueeze(0),
                                torch.arange(s + 1).unsqueeze(0), None, None)
            torch.testing.assert_close(h[0, s], outs[0][s], atol=1e-5, rtol=1e-4)
            feat = h[0, s]
            for i in (1, 2):  # the chain continues with the true next tokens
                t = s + i
                out, kv = head.step(feat.view(1, 1, -1), ids[t + 1].view(1, 1), torch.tensor([[t]]), past, None)
                past = (torch.cat([past[0], kv[0]], 2), torch.cat([past[1], kv[1]], 2))
                torch.testing.assert_close(out[0, 0], outs[i][t], atol=1e-5, rtol=1e-4)
                feat = out[0, 0]


class _Recording:
    """Delegates to a drafter and records the size of every proposed tree."""

    def __init__(self, inner, sizes):
        self.inner, self.sizes = inner, sizes
        self.name, self.needs_prefill_logits, self.hidden_layers = inner.name, False, inner.hidden_layers
        self.forward_s = 0.0

    def start(self, *a):
        self.inner.start(*a)

    def propose(self, ctx):
        tree = self.inner.propose(ctx)
        self.sizes.append(tree.size - 1)
        return tree

    def observe(self, *a):
        self.inner.observe(*a)

    def describe(self):
        return self.inner.describe()


def test_eagle_greedy_equality_and_budget():
    target = tiny_llama(vocab=16, layers=4, scale=4.0)
    backend = TargetBackend(target)
    ref, _ = run(backend, make_drafter("ar", 16), [1, 2, 3, 4], SamplingParams(), 40, 0)
    for draft_ids, top_k, depth, budget in (([0, 1, 2, 3, 5, 8, 13, 15], 3, 4, 10), (list(range(16)), 4, 6, 30),
                                           (list(range(16)), 2, 0, 5)):
        drafter = make_drafter("eagle", 16, target=target, head=random_head(target, draft_ids), top_k=top_k,
                               depth=depth)
        sizes = []
        out, st = run(backend, _Recording(drafter, sizes), [1, 2, 3, 4], SamplingParams(), 40, budget)
        assert out == ref
        assert max(sizes) == min(budget, top_k + depth * top_k ** 2)  # the rerank fills the budget from its pool


@with_negative_control
def test_eagle_sampling_through_the_loop_matches_ar(broken, monkeypatch):
    vocab, prompt, params = SAMPLING_VOCAB, SAMPLING_PROMPT, SAMPLING_PARAMS
    target, exact, backend = sampling_problem(4)
    drafter = make_drafter("eagle", vocab, target=target, head=random_head(target, [0, 1, 2, 4], seed=4), top_k=2,
                           depth=2)
    check_loop(monkeypatch, broken, lambda n: sample_counts(backend, drafter, prompt, params, 5, n), exact,
               N_NEGATIVE if broken else 5000, "eagle tree")
