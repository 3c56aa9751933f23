"""LOSSY rules and truncation sampling on the llama.cpp backend, the draft model on llama.cpp too (issue 28).

The target and the draft are the tiny random Llamas of the transformers lossy tests, written as fp32 GGUFs
(``tiny_gguf``), so the expected distributions are the same closed forms enumerated from the transformers
models; only the tokens come out of llama.cpp. Each check is the pooled chi-square of ``tests/stattest.py``
(false-alarm rate ``ALPHA`` per check); the lossy checks show their power by failing against the lossless
target, the truncation check by its negative control (a verifier that drops the sampling settings)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specgraft.core.sampling import SamplingParams, target_probs
from specgraft.lossy.rules import Lenience, SpecCascade, Typical, CapOnly, tree_node_yield
from specgraft.registry import make_drafter

from ..conftest import tiny_llama
from ..stattest import N_NEGATIVE, assert_matches, check_loop, with_negative_control
from .tiny_gguf import write_llama_gguf

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow

VOCAB, PROMPT = 6, [1, 2, 3, 1, 2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(seed, scale) -> (transformers model, llama.cpp backend on the same weights)``, cached."""
    from specgraft.backends.llamacpp import LlamaCppBackend, LlamaModel, LlamaSettings

    made: dict = {}

    def get(seed: int, scale: float):
        if (seed, scale) not in made:
            model = tiny_llama(vocab=VOCAB, scale=scale, seed=seed)
            path = write_llama_gguf(model, tmp_path_factory.mktemp("gguf") / f"tiny-{seed}-{scale}.gguf")
            made[seed, scale] = model, LlamaCppBackend(LlamaModel(path, LlamaSettings(n_ctx=256)), hidden=False)
        return made[seed, scale]

    return get


def probs_of(model, ids: list[int], params: SamplingParams) -> torch.Tensor:
    with torch.no_grad():
        return target_probs(model(input_ids=torch.tensor([ids])).logits[0, -1], params).double()


def engine_on(backend):
    from specgraft import Engine

    engine = Engine.from_backend(backend.clone(), None)
    engine.eos_ids = set()  # token ids only: every run makes its two tokens
    return engine


def loop_counts(engine, drafter, params, n, verify="lossless", budget=3, on_tree=None) -> dict:
    """Counts of the first two tokens over ``n`` runs seeded 0..n-1 through the engine loop."""
    counts: dict = {}
    for i in range(n):
        seen = []
        engine.add_request(PROMPT, drafter=drafter, sampling=replace(params, seed=i), max_new_tokens=2,
                           budget=budget, verify=verify, on_verify=lambda tree, logits: seen.append(tree))
        (g,) = engine.run().values()
        key = tuple(g.token_ids)
        counts[key] = counts.get(key, 0) + 1
        if on_tree is not None and seen:
            on_tree(key[0], seen[0])
    return counts


def test_the_gguf_runs_the_transformers_weights(tiny):
    """The premise of every check below: llama.cpp's logits equal the transformers model's to ~1e-4."""
    model, backend = tiny(3, 3.0)
    be = backend.clone()
    out = be.prefill(torch.tensor(PROMPT), all_logits=True).logits
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([PROMPT])).logits[0]
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-3), (out - ref).abs().max()


@with_negative_control
def test_lossless_sd_under_truncation_sampling_matches_ar(broken, monkeypatch, tiny):
    """The correct baselines on llama.cpp: min-p / eta sampling decoded with lossless SD (the draft model's
    chain on llama.cpp) follow AR min-p / eta sampling, enumerated on the transformers weights."""
    target, backend = tiny(3, 8.0)  # sharp enough for truncation to remove tokens
    _, draft = tiny(11, 8.0)
    engine, drafter = engine_on(backend), make_drafter("draft", VOCAB, model=draft)
    for params in (SamplingParams(0.9, min_p=0.3), SamplingParams(0.9, eta=0.3)):
        p1, exact = probs_of(target, PROMPT, params), {}
        for t1 in range(VOCAB):
            p2 = probs_of(target, PROMPT + [t1], params)
            exact.update({(t1, t2): float(p1[t1] * p2[t2]) for t2 in range(VOCAB)})
        assert sum(v == 0 for v in exact.values()) > 0  # truncation removed outcomes
        check_loop(monkeypatch, broken, lambda n: loop_counts(engine, drafter, params, n), exact,
                   N_NEGATIVE if broken else 1000, f"llama.cpp {params}")


@pytest.mark.parametrize("rule", [Lenience(0.4), SpecCascade(0.3), CapOnly(0.3)], ids=lambda r: r.spec)
def test_lossy_chain_matches_closed_form(rule, tiny):
    """Token 2 (the first verified one) follows ``rule.induced(p, q)`` with p and q from the transformers
    weights; token 1 follows p. The same counts fail against the lossless target (the check has power).
    CapOnly runs through ``InducedTarget`` (lossless SD against its pi), the others through their gates."""
    target, backend = tiny(3, 3.0)
    draft_model, draft = tiny(11, 3.0)
    params, n = SamplingParams(0.9), 1200
    p1 = probs_of(target, PROMPT, params)
    induced, lossless = {}, {}
    for t1 in range(VOCAB):
        p2 = probs_of(target, PROMPT + [t1], params)
        pi = rule.induced(p2, probs_of(draft_model, PROMPT + [t1], params))
        for t2 in range(VOCAB):
            induced[(t1, t2)], lossless[(t1, t2)] = float(p1[t1] * pi[t2]), float(p1[t1] * p2[t2])
    counts = loop_counts(engine_on(backend), make_drafter("draft", VOCAB, model=draft), params, n, rule)
    assert_matches(counts, induced, n, f"llama.cpp {rule.spec}")
    with pytest.raises(AssertionError):
        assert_matches(counts, lossless, n, "lossless")


@pytest.mark.parametrize("rule", [Typical(0.2), SpecCascade(0.3)], ids=lambda r: r.spec)
def test_lossy_tree_matches_node_yield(rule, tiny):
    """Tree mode (the draft model's deterministic candidate trees on llama.cpp): token 2 follows the exact yield
    of the rule's gate over the root's children in sibling order (``tree_node_yield``), p from the
    transformers weights; the same counts fail against the lossless target."""
    target, backend = tiny(3, 3.0)
    _, draft = tiny(11, 3.0)
    params, n = SamplingParams(0.9), 1200
    drafter = make_drafter("draft", VOCAB, model=draft, shape="tree", top_k=3, depth=2)
    children: dict[int, list[int]] = {}

    def record(t1, tree):  # the drafted tree is deterministic given the context: one per first token
        kids = [int(tree.tokens[c]) for c in tree.children[0]]
        assert children.setdefault(t1, kids) == kids
        assert int(tree.tokens[0]) == t1

    counts = loop_counts(engine_on(backend), drafter, params, n, rule, budget=4, on_tree=record)
    assert all(len(k) >= 2 for k in children.values())  # real sibling choices were verified
    p1 = probs_of(target, PROMPT, params)
    induced, lossless = {}, {}
    for t1, kids in children.items():
        p2 = probs_of(target, PROMPT + [t1], params)
        y = tree_node_yield(rule, p2, kids)
        for t2 in range(VOCAB):
            induced[(t1, t2)], lossless[(t1, t2)] = float(p1[t1] * y[t2]), float(p1[t1] * p2[t2])
    assert set(children) == {k[0] for k in counts}
    assert_matches(counts, induced, n, f"llama.cpp tree {rule.spec}")
    with pytest.raises(AssertionError):
        assert_matches(counts, lossless, n, "lossless")
