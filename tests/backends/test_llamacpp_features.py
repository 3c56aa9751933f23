"""Hidden states out of llama.cpp (``backends/llamacpp_features.py``) on SmolLM2's GGUF, and the EAGLE-3 head and
Graft on it: both taps read the same features, at the right layer, at every tree node as a one-token decode
would; a library without the symbols gets one clear error; greedy EAGLE / Graft equal llama.cpp AR; sampling
through an EAGLE tree follows AR's exact joint (with its negative control)."""

from __future__ import annotations

import pytest
import torch

from specgraft.core.sampling import SamplingParams
from specgraft.core.tree import Tree
from specgraft.errors import SpecgraftError
from specgraft.registry import make_drafter

from ..stattest import N_NEGATIVE, check_loop, with_negative_control
from .test_llamacpp import PROMPT, exact_joint, first_divergence_gap, path_of, random_tree

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow

LAYERS = (2, 15, 27)  # the SmolLM2 head's features (its config.json)


@pytest.fixture(scope="module")
def engine():
    from specgraft import Engine

    return Engine("smollm2-135m", backend="llamacpp")


@pytest.fixture()
def tap_backend(engine, monkeypatch):
    """A context whose features come through the eval callback (the path of architectures without the
    layer-input API, e.g. qwen2), on the same weights."""
    from specgraft.backends import llamacpp_features

    monkeypatch.setattr(llamacpp_features, "LAYER_INPUT_ARCHS", frozenset())
    be = engine.backend.clone()
    monkeypatch.undo()  # every other context of the test keeps the layer-input API
    assert be._tap.kind == "eval callback" and be.capabilities.hidden_states
    return be


def single_step_hidden(engine, ids: list[int], start: int) -> dict[int, torch.Tensor]:
    """Features at ``ids[start:]`` taken one token per decode (AR's kernel path)."""
    be = engine.backend.clone()
    be.prefill(torch.tensor(ids[:start]))
    rows: dict[int, list] = {i: [] for i in LAYERS}
    for t in ids[start:]:
        h = be.verify(Tree.chain(t, []), hidden_layers=LAYERS).hidden
        for i in LAYERS:
            rows[i].append(h[i][0])
        be.commit([0])
    return {i: torch.stack(r) for i, r in rows.items()}


def test_both_taps_read_the_same_features_at_every_tree_node(engine, tap_backend):
    api = engine.backend.clone()
    assert api._tap.kind == "layer-input API" and tap_backend._tap.kind == "eval callback"
    tree = random_tree(20, seed=3)
    outs = []
    for be in (api, tap_backend):
        pre = be.prefill(torch.tensor(PROMPT), hidden_layers=LAYERS)
        assert {i: tuple(h.shape) for i, h in pre.hidden.items()} == {i: (len(PROMPT), 576) for i in LAYERS}
        outs.append((pre, be.verify(tree, hidden_layers=LAYERS)))
    (pre_a, ver_a), (pre_b, ver_b) = outs
    for i in LAYERS:  # the callback copies the tensor the layer-input API reads: bit for bit
        assert torch.equal(pre_a.hidden[i], pre_b.hidden[i]) and torch.equal(ver_a.hidden[i], ver_b.hidden[i])
    assert torch.equal(ver_a.logits, ver_b.logits)
    for node in range(tree.size):  # a tree node's features are those of its path decoded one token at a time
        ref = single_step_hidden(engine, PROMPT + path_of(tree, node), len(PROMPT))
        for i in LAYERS:
            assert torch.allclose(ver_a.hidden[i][node], ref[i][-1], rtol=1e-4, atol=1e-3), (node, i)


def test_features_are_the_input_of_the_named_layer(engine):
    """Against transformers on the same (dequantised) weights: layer ``i``'s features match its
    ``hidden_states[i]`` (cosine > 0.99) and match it better than the neighbouring layers' (no off-by-one)."""
    from specgraft.models import load

    hf, _ = load("smollm2-135m", "float32")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    got = engine.backend.clone().prefill(torch.tensor(PROMPT), hidden_layers=LAYERS).hidden
    for i in LAYERS:
        cos = {j: float(torch.nn.functional.cosine_similarity(got[i], ref[j][0], -1).mean()) for j in (i - 1, i, i + 1)}
        assert cos[i] > 0.99 and cos[i] > max(cos[i - 1], cos[i + 1]), (i, cos)


def test_logits_unchanged_by_reading_features(engine):
    plain = engine.backend.clone()
    plain.prefill(torch.tensor(PROMPT))
    tree = random_tree(12, seed=5)
    want = plain.verify(tree).logits
    be = engine.backend.clone()
    be.prefill(torch.tensor(PROMPT), hidden_layers=LAYERS)
    assert torch.equal(be.verify(tree, hidden_layers=LAYERS).logits, want)


def test_missing_symbols_give_one_clear_error(engine, monkeypatch):
    from specgraft.backends import llamacpp_features

    monkeypatch.setattr(llamacpp_features, "SET_SYMBOL", "_Z99llama_no_such_symbol")
    with pytest.raises(SpecgraftError, match="does not export llama_set/get_embeddings_layer_inp"):
        llamacpp_features.bind_layer_inputs()
    be = engine.backend.clone()  # no tap: the backend says so instead of aborting the process
    assert not be.capabilities.hidden_states
    with pytest.raises(SpecgraftError, match="does not export"):
        be.prefill(torch.tensor(PROMPT), hidden_layers=LAYERS)
    with pytest.raises(SpecgraftError, match="hidden states"):
        make_drafter("eagle", engine.vocab_size, target_name="smollm2-135m", backend=be)


def test_out_of_range_layer_refused_before_the_step_touches_the_cache(engine, tap_backend):
    for be in (engine.backend.clone(), tap_backend):
        with pytest.raises(SpecgraftError, match="layer"):
            be.prefill(torch.tensor(PROMPT), hidden_layers=(30,))
        be.prefill(torch.tensor(PROMPT))
        free = len(be._free)
        with pytest.raises(SpecgraftError, match="layer"):
            be.verify(random_tree(6, seed=2), hidden_layers=(0 if be._tap.kind == "eval callback" else 31,))
        assert len(be._free) == free and be.prefix_len == len(PROMPT)  # no id borrowed, nothing cached


def test_a_failed_feature_read_leaves_the_next_one_clean(tap_backend):
    """The callback cannot raise through C: its error is kept, reported by take, and cleared by the next decode."""
    tap_backend.prefill(torch.tensor(PROMPT))
    tap = tap_backend._tap
    tap.want(LAYERS)
    tap.begin(True)
    tap.found = {2: [torch.zeros(3, 576).numpy()]}  # what a failed decode could leave behind
    tap.error = "boom"
    with pytest.raises(SpecgraftError, match="boom"):
        tap.take(LAYERS, 1)
    out = tap_backend.verify(Tree.chain(PROMPT[-1], [900]), hidden_layers=LAYERS)
    assert {i: tuple(h.shape) for i, h in out.hidden.items()} == {i: (2, 576) for i in LAYERS}


from ..test_smollm2 import PROMPTS  # noqa: E402  the transformers exactness test's prompts

# the head shipped for SmolLM2 and its Graft calibration; trees under 64 nodes (llama.cpp's exact kernel path)
HEAD_METHODS = [("eagle", {"budget": 24}), ("graft", {"budget": 24}), ("graft", {"budget": 24, "context": "off"}),
                ("prune", {"budget": 24})]


def test_eagle_and_graft_on_the_head_equal_llamacpp_ar(engine):
    diverged, steps, tokens, runs = [], {}, 0, 0
    for prompt in PROMPTS[:4]:
        ref = engine.generate(prompt, "ar", max_new_tokens=96)
        tokens += len(ref.token_ids) - 1
        for method, opts in HEAD_METHODS:
            g = engine.generate(prompt, method, max_new_tokens=96, **opts)
            key = f"{method} {opts}"
            steps[key] = steps.get(key, 0) + g.stats.steps
            runs += 1
            if g.token_ids != ref.token_ids:
                gap = first_divergence_gap(engine, ref, g)
                assert gap < 1.0, f"{key} {prompt[:30]}: differs from AR, logit gap {gap:.3g} is not a near-tie"
                diverged.append((key, prompt[:30], round(gap, 3)))
    print(f"{runs - len(diverged)}/{runs} runs identical to AR; near-tie divergences: {diverged}")
    assert len(diverged) <= runs // 8, diverged
    assert all(s < 0.8 * tokens for s in steps.values()), steps  # the head's drafts were accepted


@with_negative_control
def test_eagle_sampling_through_the_loop_matches_ar(broken, monkeypatch, engine):
    """The first three sampled tokens (top-k 3, T = 1) with EAGLE trees on llama.cpp follow AR's exact joint
    (one-token decodes); a verifier that ignores top-k and the residual must fail."""
    params, prompt = SamplingParams(temperature=1.0, top_k=3), PROMPT[:7]
    exact = exact_joint(engine, prompt, params)
    drafter = make_drafter("eagle", engine.vocab_size, target_name="smollm2-135m", backend=engine.backend,
                           top_k=3, depth=2)
    spec = []

    def sample(n):
        counts = {}
        for i in range(n):
            engine.add_request(prompt, drafter=drafter, max_new_tokens=3, budget=6,
                               sampling=SamplingParams(1.0, 3, 1.0, seed=i))
            (g,) = engine.run().values()
            counts[tuple(g.token_ids)] = counts.get(tuple(g.token_ids), 0) + 1
            spec.append(g.stats.mat > 1)
        return counts

    n = N_NEGATIVE if broken else 1500
    check_loop(monkeypatch, broken, sample, exact, n, "eagle on llama.cpp")
    assert sum(spec) > n / 10, sum(spec)
