"""The engine's request lifecycle under failure (issue 23): admission is all or nothing, a stream the caller
leaves early leaves the batch, drafter prototypes are bounded and a failed build is not retried, resources are
reserved at admission, and the draft-forward counter never goes negative."""

from __future__ import annotations

import pytest
import torch

import specgraft.engine as engine_mod
from specgraft.core.drafter import NoDraft
from specgraft.core.sampling import SamplingParams
from specgraft.engine import Engine, NoCapacity
from specgraft.errors import SpecgraftError

from ..conftest import tiny_llama


@pytest.fixture
def engine():
    e = Engine.from_model(tiny_llama(), None)
    e.eos_ids = set()
    return e


def test_admission_failing_after_the_prefill_leaves_no_row(engine, monkeypatch):
    def broken(logits, params, gen):
        raise RuntimeError("multinomial: probabilities contain NaN")

    monkeypatch.setattr(engine_mod, "first_token", broken)
    with pytest.raises(RuntimeError):
        engine.add_request([1, 2, 3], "ar", max_new_tokens=8)
    assert engine.active == [] and engine.backend.rows == 0 and engine.pending() == []


def test_bad_sampling_values_are_refused_before_anything_runs(engine):
    for bad in (dict(temperature=1e-39), dict(temperature=0.5, seed=2**64)):
        with pytest.raises(SpecgraftError, match="temperature|seed"):
            engine.add_request([1, 2, 3], "ar", sampling=SamplingParams(**bad))
    assert engine.backend.rows == 0
    # the edges still run: the largest seed, the smallest temperature
    engine.add_request([1, 2, 3], "ar", sampling=SamplingParams(1e-5, seed=2**63 - 1), max_new_tokens=3)
    assert all(len(g.token_ids) == 3 for g in engine.run().values())


def test_a_stream_left_early_leaves_the_batch(tiny_engine):
    engine = tiny_engine
    other = engine.add_request("Count to a hundred.", "ar", max_new_tokens=50)
    stream = engine.stream("Tell me a story.", "pld", max_new_tokens=50)
    for i, _ in enumerate(stream):
        if i == 2:
            break  # the iterator is dropped: the request is aborted now, not left decoding
    assert [r.id for r in engine.active] == [other] and engine.backend.rows == 1
    with engine.stream("Tell me a story.", "ar", max_new_tokens=50) as s:
        next(iter(s))
    assert [r.id for r in engine.active] == [other]
    assert all(o.request_id == other for o in engine.pending())  # its abort output is not left behind
    engine.abort(other)
    engine.step()


def test_a_stream_whose_step_raises_leaves_the_batch(engine, monkeypatch):
    real, calls = engine.backend.verify_batch, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real(*a, **k)

    monkeypatch.setattr(engine.backend, "verify_batch", flaky)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate([1, 2, 3], "ar", max_new_tokens=20)
    assert engine.active == [] and engine.backend.rows == 0


def test_backlog_is_bounded(engine, monkeypatch):
    monkeypatch.setattr(engine_mod, "BACKLOG", 8)
    engine.backlog = engine_mod.collections.deque(maxlen=engine_mod.BACKLOG)
    engine.add_request([4, 5, 6], "ar", max_new_tokens=60)
    engine.generate([1, 2, 3], "ar", max_new_tokens=30)
    assert len(engine.backlog) == 8


def test_drafter_prototypes_are_bounded_and_a_failed_build_is_not_retried(engine, monkeypatch):
    for n in range(1, engine_mod.MAX_DRAFTERS + 6):
        engine.drafter("pld", max_ngram=n)
    assert len(engine._drafters) == engine_mod.MAX_DRAFTERS
    calls = {"n": 0}

    def failing(*a, **k):
        calls["n"] += 1
        raise SpecgraftError("cannot load the draft model")

    monkeypatch.setattr(engine_mod, "make_drafter", failing)
    for _ in range(3):
        with pytest.raises(SpecgraftError, match="cannot load"):
            engine.add_request([1, 2, 3], "draft", max_new_tokens=4)
    assert calls["n"] == 1 and engine.backend.rows == 0


class Failing(NoDraft):
    """A drafter that ran draft forwards on earlier steps (forward_s > 0), then fails in propose."""

    name = "failing"

    def __init__(self, steps_ok: int):
        self.steps_ok, self.forward_s = steps_ok, 0.0

    def fork(self):
        return self

    def propose(self, ctx):
        if self.steps_ok == 0:
            raise RuntimeError("drafter bug")
        self.steps_ok -= 1
        self.forward_s += 0.5
        return super().propose(ctx)


def test_draft_forward_time_counts_only_this_steps_forwards(engine):
    engine.add_request([1, 2, 3], drafter=Failing(steps_ok=3), max_new_tokens=20)
    engine.add_request([4, 5], "ar", max_new_tokens=20)
    outs = [o for o in engine.outputs()]
    assert any(o.finished and o.error for o in outs)
    assert engine.totals.draft_forward_s == pytest.approx(1.5)  # the failing request's 3 steps, never negative


class Pool:
    """A backend resource of 60 units; each request holds prompt + new + budget + 1 of it."""

    @staticmethod
    def capacity():
        return {"units": 60}

    @staticmethod
    def reservation(prompt_len, max_new, budget):
        return {"units": prompt_len + max_new + budget + 1}


def test_admission_reserves_the_backends_resources(engine, monkeypatch):
    monkeypatch.setattr(engine.backend, "capacity", Pool.capacity)
    monkeypatch.setattr(engine.backend, "reservation", Pool.reservation)
    engine.add_request([1, 2, 3], "ar", max_new_tokens=30)  # 34 units
    with pytest.raises(NoCapacity) as info:
        engine.add_request([1, 2, 3], "pld", max_new_tokens=20, budget=4)  # 28 more: 62 > 60
    assert info.value.need == {"units": 28} and engine.backend.rows == 1
    assert engine.fits({"units": 26}) and not engine.fits(info.value.need)
    with pytest.raises(SpecgraftError, match="never fit"):
        engine.add_request(list(range(1, 10)), "ar", max_new_tokens=60)
    engine.run()
    assert engine.reserved() == {} and engine.fits(info.value.need)


def test_first_tokens_are_still_emitted_at_admission(engine):
    rid = engine.add_request(torch.tensor([1, 2, 3]).tolist(), "ar", max_new_tokens=1)
    outs = engine.pending()
    assert [o.request_id for o in outs] == [rid] and outs[0].finished and len(outs[0].result.token_ids) == 1
    assert engine.active == []


def test_a_request_the_policy_gives_no_tree_does_no_matrix_work_until_it_drafts(engine, monkeypatch):
    """Under the server's policy, a request joining a batch where it gets no tree is prefilled without the
    [P, V] logits its matrix warms up on, and its budget-0 steps skip the matrix update (a top-k over the
    vocabulary). Once the policy gives it a tree it learns again. Greedy text stays AR's throughout."""
    prompt = [5, 6, 7, 8, 5, 6, 9, 10]
    ar = engine.add_request(prompt, "ar", max_new_tokens=16)
    expected = engine.run()[ar].token_ids
    asked, real_add = [], engine.backend.add

    def add(ids, rows, hidden_layers):
        asked.append(rows is not False)
        return real_add(ids, rows, hidden_layers)

    monkeypatch.setattr(engine.backend, "add", add)
    crowded = [True]
    engine.budget_policy = lambda req, batch: 0 if crowded[0] and batch >= 2 else req.budget
    alone = engine.add_request(prompt, "recycle", max_new_tokens=16)
    joined = engine.add_request(prompt, "recycle", max_new_tokens=16)
    warm, cold = (r.drafter for r in engine.active)
    assert asked == [True, False]  # the second joined a batch of two: no prompt logits
    assert warm.matrix.rows_filled > 0 and cold.matrix.rows_filled == 0
    updates = []
    for d in (warm, cold):
        monkeypatch.setattr(d.matrix, "update", lambda *a, real=d.matrix.update, d=d: updates.append(d) or real(*a))
    for _ in range(3):
        engine.step()
    assert updates == []  # budget-0 steps
    crowded[0] = False
    engine.step()
    assert updates == [warm, cold] and cold.matrix.rows_filled > 0
    out = engine.run()
    assert out[alone].token_ids == out[joined].token_ids == expected
