"""The engine with B > 1 requests: one batched forward per step, ragged acceptance, requests joining and
leaving (docs/design.md §2). Greedy outputs equal each request decoded alone; under sampling a request's
tokens depend only on its own seed."""

import torch

from specgraft.core.sampling import SamplingParams
from specgraft.engine import Engine
from specgraft.graft.drafter import GraftDrafter
from specgraft.graft.pruning import SparseGate
from specgraft.registry import make_drafter

from ..conftest import tiny_llama
from ..eagle.test_head import random_head
from ..stattest import N_NEGATIVE, check_loop, with_negative_control
from .test_engine import decode

PROMPTS = [[1, 2, 3, 4], [9, 9, 2, 7, 7, 3, 1], [5], [3, 1, 4, 1, 5, 9, 2, 6]]


def token_engine(target) -> Engine:
    engine = Engine.from_model(target, None)
    engine.eos_ids = set()
    return engine


def mixed_drafters(target):
    """One drafter per kind the engine batches: EAGLE, Graft (two variants), Token Recycling, PLD, AR."""
    head = random_head(target, [0, 1, 2, 3, 5, 8, 13, 15])

    def eagle():
        return make_drafter("eagle", 16, target=target, head=head, top_k=3, depth=4)

    return {"eagle": eagle, "graft-batch": lambda: GraftDrafter(eagle(), 16, "batch", SparseGate((0.6, 0.5, 0.4))),
            "graft": lambda: GraftDrafter(eagle(), 16, "graft", SparseGate((0.6, 0.5, 0.4))),
            "recycle": lambda: make_drafter("recycle", 16), "pld": lambda: make_drafter("pld", 16),
            "ar": lambda: make_drafter("ar", 16)}


def test_batch_equals_single_requests_mixed_methods():
    target = tiny_llama(vocab=16, layers=4, scale=4.0)
    refs = [decode(target, make_drafter("ar", 16), p, SamplingParams(), 60, 0).token_ids for p in PROMPTS]
    kinds = mixed_drafters(target)
    names = list(kinds)
    for shift in range(2):  # every prompt meets two different methods
        engine = token_engine(target)
        ids = {}
        for i, p in enumerate(PROMPTS):
            name = names[(i + shift * 3) % len(names)]
            ids[engine.add_request(p, drafter=kinds[name](), max_new_tokens=60, budget=6)] = (i, name)
        widest = 0
        results = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    results[o.request_id] = o.result
            if engine.active:  # the cache holds the longest prefix plus at most one tree's columns
                width = engine.backend.cache.layers[0].keys.shape[2]
                assert width <= max(engine.backend.lengths) + 7
                widest = max(widest, width)
        for rid, (i, name) in ids.items():
            assert results[rid].token_ids == refs[i], (name, i)
            assert results[rid].finish_reason == "length"
            if name != "ar":
                assert results[rid].stats.mat > 1.0, name
        assert engine.backend.rows == 0 and engine.backend.cache is None
        assert widest > 60  # the cache grew with the sequences (no premature truncation)


def test_requests_join_mid_flight_and_abort():
    target = tiny_llama(vocab=16, layers=4, scale=4.0)
    kinds = mixed_drafters(target)
    refs = [decode(target, kinds["graft"](), p, SamplingParams(), 40, 6).token_ids for p in PROMPTS]
    engine = token_engine(target)
    a = engine.add_request(PROMPTS[0], drafter=kinds["graft"](), max_new_tokens=40, budget=6)
    b = engine.add_request(PROMPTS[1], drafter=kinds["graft"](), max_new_tokens=40, budget=6)
    streamed: dict[int, list[int]] = {}
    results = {}
    late = {}
    for step in range(200):
        if step == 3:  # two requests join after three steps
            late[engine.add_request(PROMPTS[2], drafter=kinds["graft"](), max_new_tokens=40, budget=6)] = 2
            late[engine.add_request(PROMPTS[3], drafter=kinds["graft"](), max_new_tokens=40, budget=6)] = 3
        if step == 5:
            assert engine.abort(b) and not engine.abort(12345)
        for o in engine.step():
            streamed.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                results[o.request_id] = o.result
        assert engine.backend.rows == len(engine.active)
        if not engine.has_unfinished():
            break
    assert results[a].token_ids == refs[0] == streamed[a]
    for rid, i in late.items():
        assert results[rid].token_ids == refs[i] == streamed[rid]
    aborted = results[b]
    assert aborted.finish_reason == "abort" and 1 <= len(aborted.token_ids) < 40
    assert aborted.token_ids == refs[1][: len(aborted.token_ids)] == streamed[b]
    assert not engine.abort(b)  # already gone


def test_graft_forks_share_the_matrix_only_with_global_scope():
    target = tiny_llama(vocab=16, layers=4, scale=4.0)
    head = random_head(target, list(range(16)), seed=2)
    with torch.no_grad():
        head.lm_head.weight.div_(20)  # an unsure head: stages fire, retrieval replaces draft nodes
    for scope in ("request", "global"):
        proto = GraftDrafter(make_drafter("eagle", 16, target=target, head=head, top_k=3, depth=6), 16, "batch",
                             SparseGate((0.9, 0.9, 0.9)), scope=scope)
        forks = [proto.fork() for _ in PROMPTS]
        assert all((f.matrix is proto.matrix) == (scope == "global") for f in forks)
        assert all(f.inner is not proto.inner and f.inner.head is proto.inner.head for f in forks)
        engine = token_engine(target)
        for f, p in zip(forks, PROMPTS):
            engine.add_request(p, drafter=f, max_new_tokens=30, budget=10)
        results = engine.run()
        for g in results.values():
            c, steps = g.config["drafter"]["counters"], g.stats.steps
            assert c["offered_retrieval"] > 0 and c["offered_draft"] > 0
            assert c["offered_retrieval"] + c["offered_draft"] <= 10 * steps
            assert sum(g.config["drafter"]["stage_histogram"].values()) == steps  # a stage decision every step
        if scope == "request":
            assert proto.matrix.rows_filled == 0  # every request filled its own matrix
        else:
            assert proto.matrix.rows_filled > 0  # one matrix, written by all of them


def test_sampled_tokens_depend_only_on_the_request_seed():
    """The same request (prompt, seed) alone and in a batch of three others with other seeds and methods."""
    target = tiny_llama(vocab=16, layers=2, scale=2.0, seed=4)
    kinds = mixed_drafters(target)
    params = SamplingParams(temperature=0.8, top_k=8, seed=11)
    for name in ("graft", "recycle", "ar"):
        alone = decode(target, kinds[name](), PROMPTS[0], params, 30, 6).token_ids
        engine = token_engine(target)
        others = [engine.add_request(p, drafter=kinds[n](), sampling=SamplingParams(0.8, 8, seed=s),
                                     max_new_tokens=n_new, budget=6)
                  for p, n, s, n_new in ((PROMPTS[1], "eagle", 1, 12), (PROMPTS[3], "pld", 2, 40))]
        rid = engine.add_request(PROMPTS[0], drafter=kinds[name](), sampling=params, max_new_tokens=30, budget=6)
        others.append(engine.add_request(PROMPTS[2], drafter=kinds["graft"](), sampling=SamplingParams(0.8, 8, seed=3),
                                         max_new_tokens=20, budget=6))
        results = engine.run()
        assert results[rid].token_ids == alone, name
        assert len(results) == 4


@with_negative_control
def test_batch_sampling_matches_ar(broken, monkeypatch):
    """Under sampling each request of a batch follows the AR distribution: two requests per batch (the same
    prompt, own seeds), the first three tokens of both pooled; the negative control breaks the verifier the
    engine calls and must fail."""
    from .test_engine import exact_ar_joint

    vocab = 6
    target = tiny_llama(vocab=vocab, scale=3.0, seed=3)
    prompt = [1, 2, 3, 1, 2]
    exact = exact_ar_joint(target, prompt, SamplingParams(temperature=0.9, top_k=5), vocab)

    def sample(n: int) -> dict:
        counts: dict = {}
        for i in range(n // 2):  # seeds 2i and 2i + 1: distinct for every request of the run
            engine = token_engine(target)
            for s in (2 * i, 2 * i + 1):
                engine.add_request(prompt, drafter=make_drafter("recycle", vocab), max_new_tokens=3, budget=8,
                                   sampling=SamplingParams(0.9, 5, seed=s))
            for g in engine.run().values():
                counts[tuple(g.token_ids)] = counts.get(tuple(g.token_ids), 0) + 1
        return counts

    n = N_NEGATIVE if broken else 4000
    check_loop(monkeypatch, broken, sample, exact, n, "batch")


def test_a_request_whose_drafter_fails_to_start_leaves_no_row():
    target = tiny_llama(vocab=16, layers=2, scale=4.0)
    engine = token_engine(target)
    keep = engine.add_request(PROMPTS[0], drafter=make_drafter("recycle", 16), max_new_tokens=20, budget=6)

    class Broken:
        name, needs_prefill_logits, hidden_layers, forward_s = "broken", False, (), 0.0

        def start(self, *a):
            raise RuntimeError("cannot start")

    try:
        engine.add_request(PROMPTS[1], drafter=Broken(), max_new_tokens=20)
    except RuntimeError:
        pass
    else:
        raise AssertionError("the failing start was swallowed")
    assert engine.backend.rows == len(engine.active) == 1
    solo = decode(target, make_drafter("recycle", 16), PROMPTS[0], SamplingParams(), 20, 6).token_ids
    assert engine.run()[keep].token_ids == solo


def test_a_drafter_that_raises_mid_flight_ends_only_its_own_request():
    """propose or observe raising: that request finishes with reason "error" (and its row is freed); the
    others go on and still equal their solo outputs."""
    target = tiny_llama(vocab=16, layers=2, scale=4.0)
    engine = token_engine(target)
    keep = engine.add_request(PROMPTS[0], drafter=make_drafter("recycle", 16), max_new_tokens=20, budget=6)
    bad = {}
    for where in ("propose", "observe"):
        d = make_drafter("pld", 16)
        calls = {"n": 0}
        real = getattr(d, where)

        def flaky(*a, _real=real, _calls=calls, _where=where):
            _calls["n"] += 1
            if _calls["n"] == 3:
                raise ValueError(f"{_where} broke")
            return _real(*a)

        setattr(d, where, flaky)
        bad[engine.add_request(PROMPTS[1], drafter=d, max_new_tokens=20, budget=4)] = where
    finals = {o.request_id: o for o in engine.outputs() if o.finished}
    for rid, where in bad.items():
        assert finals[rid].result.finish_reason == "error" and f"{where} broke" in finals[rid].error
    solo = decode(target, make_drafter("recycle", 16), PROMPTS[0], SamplingParams(), 20, 6).token_ids
    assert finals[keep].result.token_ids == solo and engine.backend.rows == 0


def test_step_outputs_label_every_token_with_its_source(tiny_engine):
    """The first token comes from the prefill, a step's last from the target (bonus), the rest from the drafter;
    ``segments`` re-split each output's text by source and always join back to it."""
    engine = tiny_engine
    for method in ("ar", "recycle", "pld"):
        rid = engine.add_request("Say something long and repetitive please.", method, max_new_tokens=40,
                                 stop=("zzz",))
        outs = [o for o in engine.outputs() if o.request_id == rid]
        assert outs[0].sources == ["prefill"]
        for o in outs[1:]:
            assert len(o.sources) == len(o.token_ids) and o.accepted <= o.draft_tokens
            if o.token_ids and not o.finished:
                assert o.sources[-1] == "bonus" and len(o.token_ids) == o.accepted + 1
            assert set(o.sources[:-1]) <= ({"recycle": {"matrix"}, "pld": {"context"}}.get(method, set()))
            assert "".join(t for t, _ in o.segments) == o.text
        if method != "ar":
            assert any(set(o.sources) & {"matrix", "context"} for o in outs)
        assert "".join(o.text for o in outs) == outs[-1].result.text
