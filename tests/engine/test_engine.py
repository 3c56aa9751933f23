"""The engine loop at B = 1 on a tiny random model: greedy equality for every drafter, sampling distribution.
(B > 1, joining and aborting requests: test_batch.py.)"""


import numpy as np
import torch

from dataclasses import replace

from specgraft.core.backend import TargetBackend
from specgraft.engine import Engine
from specgraft.registry import make_drafter
from specgraft.core.drafter import DraftContext
from specgraft.core.sampling import SamplingParams, target_probs
from specgraft.core.tree import Tree

from ..conftest import tiny_llama
from ..stattest import N_NEGATIVE, check_loop, with_negative_control


def decode(model, drafter, prompt, params, n, budget, eos=frozenset(), verify="lossless"):
    """One request through the engine (a token-level engine: no tokenizer); its :class:`Generation`."""
    engine = Engine.from_model(model, None)
    engine.eos_ids = set(eos)
    engine.add_request(prompt, drafter=drafter, sampling=params, max_new_tokens=n, budget=budget, verify=verify)
    (result,) = engine.run().values()
    return result


def run(backend, drafter, prompt, params, n, budget, seed=0, eos=frozenset()):
    """Tokens and stats of one request; ``seed`` seeds its generator unless ``params`` carries one."""
    params = params if params.greedy or params.seed is not None else replace(params, seed=seed)
    g = decode(backend.model, drafter, prompt, params, n, budget, eos)
    return g.token_ids, g.stats


def sample_counts(backend, drafter, prompt, params, budget, n=5000, length=3) -> dict:
    """Counts of the first ``length`` tokens over ``n`` seeded runs through the loop (seed i for run i)."""
    counts: dict = {}
    for i in range(n):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed=i)
        out, _ = run(backend, drafter, prompt, p, length, budget, seed=i)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    return counts


def test_greedy_equality_all_drafters_tiny():
    model = tiny_llama(vocab=16, scale=4.0)  # sharper distributions: longer repeats, real acceptances
    backend = TargetBackend(model)
    greedy = SamplingParams()
    for prompt in ([1, 2, 3, 4, 1, 2], [5, 5, 5, 5], [7, 3, 9, 1, 12, 4, 3, 9]):
        ref, ref_stats = run(backend, make_drafter("ar", 16), prompt, greedy, 60, 0)
        assert len(ref) == 60 and ref_stats.mat == 1.0
        for method, budget in (("pld", 10), ("recycle", 80), ("recycle", 8)):
            out, st = run(backend, make_drafter(method, 16), prompt, greedy, 60, budget)
            assert out == ref, (method, budget, prompt)
            assert st.new_tokens == 60 and st.steps <= ref_stats.steps
        assert st.mat > 1.0  # retrieval accepted something on this repetitive tiny model


def test_eos_and_max_new_tokens_cut_a_step():
    model = tiny_llama(vocab=16, scale=4.0)
    backend = TargetBackend(model)
    ref, _ = run(backend, make_drafter("ar", 16), [1, 2, 3], SamplingParams(), 40, 0)
    eos = ref[17]
    first = ref.index(eos)
    out, st = run(backend, make_drafter("recycle", 16), [1, 2, 3], SamplingParams(), 40, 80, eos={eos})
    assert out == ref[: first + 1]
    out, st = run(backend, make_drafter("recycle", 16), [1, 2, 3], SamplingParams(), 7, 80)
    assert out == ref[:7] and st.new_tokens == 7 and sum(st.committed) == 6


class DuplicateDrafter:
    """Proposes a fixed-shape tree with duplicate siblings, tokens drawn from its own RNG."""

    name = "dup-test"
    needs_prefill_logits = False
    forward_s = 0.0
    hidden_layers = ()

    def __init__(self, vocab, seed=0):
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab

    def start(self, prompt_ids, prefill_logits, prefill_hidden=None):
        pass

    def propose(self, ctx: DraftContext) -> Tree:
        a, b, c = (int(x) for x in self.rng.integers(0, self.vocab, 3))
        return Tree.build([ctx.ids[-1], a, a, b, c, c, a], [-1, 0, 0, 0, 1, 1, 4])

    def observe(self, tree, logits, verdict, hidden=None):
        pass

    def describe(self):
        return {"method": self.name}


def exact_ar_joint(model, prompt: list[int], params: SamplingParams, vocab: int) -> dict:
    """P(first three new tokens) under AR sampling, by enumeration on a tiny vocabulary."""
    exact = {}
    with torch.no_grad():
        def probs(ids):
            return target_probs(model(input_ids=torch.tensor([ids])).logits[0, -1], params)

        p1 = probs(prompt)
        for t1 in range(vocab):
            p2 = probs(prompt + [t1])
            for t2 in range(vocab):
                p3 = probs(prompt + [t1, t2])
                for t3 in range(vocab):
                    exact[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    return exact


SAMPLING_VOCAB, SAMPLING_PROMPT = 6, [1, 2, 3, 1, 2]
SAMPLING_PARAMS = SamplingParams(temperature=0.9, top_k=5, seed=0)


def sampling_problem(layers: int = 2):
    """The loop-level sampling tests' set-up: a sharp tiny target, its exact AR joint of the first three
    tokens, and a backend; returns ``(target, exact, backend)``."""
    target = tiny_llama(vocab=SAMPLING_VOCAB, layers=layers, scale=3.0, seed=3)
    exact = exact_ar_joint(target, SAMPLING_PROMPT, SAMPLING_PARAMS, SAMPLING_VOCAB)
    return target, exact, TargetBackend(target)


@with_negative_control
def test_sampling_through_the_loop_matches_ar_enumeration(broken, monkeypatch):
    """Tokens 2-3 come from one tree step; their joint (given token 1) must equal AR's exact one (and a
    verifier that drops the residual must fail the same check)."""
    vocab = 6
    model = tiny_llama(vocab=vocab, scale=3.0, seed=3)
    params = SamplingParams(temperature=0.9, top_k=5)
    prompt = [1, 2, 3, 1, 2]
    exact = exact_ar_joint(model, prompt, params, vocab)
    backend = TargetBackend(model)
    for drafter in (DuplicateDrafter(vocab), make_drafter("recycle", vocab, scope="hot")):
        check_loop(monkeypatch, broken, lambda n: sample_counts(backend, drafter, prompt, params, 8, n), exact,
                   N_NEGATIVE if broken else 5000, drafter.name)
