"""The engine thread under pressure (serve/runner.py), on the tiny engine: a full queue answers 429 with
Retry-After, a deadline 504, a failing batched forward 500 for its requests only, admission all or nothing, a
dead loop 503 at once, and the loop keeps serving. Tests wait on the server's own state (``Runner.wait_for``)
or on events they control, never on sleeps."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import httpx
import pytest

import specgraft.engine as engine_mod
from specgraft.serve import app as app_mod
from specgraft.serve import runner as runner_mod
from specgraft.serve.app import Server

from .live import Live

BODY = {"messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0, "method": "ar"}


class Gate:
    """Holds engine steps until the test lets them through: :meth:`allow` n steps, or :meth:`open` for all."""

    def __init__(self, engine, monkeypatch):
        self.sem, self.free, self.real = threading.Semaphore(0), False, engine.step
        monkeypatch.setattr(engine, "step", self.step)

    def step(self):
        if not self.free:
            assert self.sem.acquire(timeout=60), "the test never let this step through"
        return self.real()

    def allow(self, n: int = 1):
        for _ in range(n):
            self.sem.release()

    def open(self):
        self.free = True
        self.sem.release()  # the step waiting now, if any

    def close(self):
        self.free = False
        while self.sem.acquire(blocking=False):
            pass


def post(url, **body):
    return httpx.post(url + "/v1/chat/completions", json={**BODY, **body}, timeout=60)


def test_full_queue_gets_429_with_retry_after(tiny_engine, monkeypatch):
    server = Server.start(tiny_engine, method="ar", max_num_seqs=1, max_queue=1, batch_budget=False)
    gate = Gate(tiny_engine, monkeypatch)
    runner = server.runner
    with Live(server) as url, cf.ThreadPoolExecutor(4) as pool:
        first = pool.submit(post, url, max_tokens=60)
        assert runner.wait_for(lambda: len(runner.running) == 1)  # admitted, its first step held at the gate
        second = pool.submit(post, url, max_tokens=5)
        assert runner.wait_for(lambda: len(runner.waiting) == 1)  # the queue (1) is full now
        third = post(url, max_tokens=5)
        assert third.status_code == 429 and int(third.headers["Retry-After"]) >= 1
        assert third.json()["error"]["type"] == "rate_limit_error" and third.json()["error"]["code"] == "queue_full"
        gate.open()
        assert first.result().status_code == 200 and second.result().status_code == 200


def test_no_queue_still_admits_into_a_free_slot(tiny_engine):
    server = Server.start(tiny_engine, method="ar", max_num_seqs=2, max_queue=0, batch_budget=False)
    with Live(server) as url:
        assert post(url, max_tokens=4).status_code == 200


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_deadline_gives_504_and_a_stream_error_event(tiny_engine, monkeypatch):
    """The runner's clock is the test's: a request's deadline passes exactly when the test says so."""
    clock = FakeClock()
    monkeypatch.setattr(runner_mod, "clock", clock)
    server = Server.start(tiny_engine, method="ar", max_num_seqs=2, timeout_s=10.0, batch_budget=False)
    runner = server.runner

    def expire_once_running():
        assert runner.wait_for(lambda: runner.running)
        clock.now += 11.0  # past the deadline: the next turn aborts it

    with Live(server) as url, cf.ThreadPoolExecutor(2) as pool:
        gate = Gate(tiny_engine, monkeypatch)
        r = pool.submit(post, url, max_tokens=200)
        expire_once_running()
        gate.open()
        r = r.result()
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        gate.close()
        with httpx.stream("POST", url + "/v1/chat/completions", json={**BODY, "max_tokens": 200, "stream": True},
                          timeout=60) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")  # the role chunk
            expire_once_running()
            gate.open()
            rest = [x for x in lines if x.startswith("data: ")]
        assert '"error"' in rest[-2] and rest[-1] == "data: [DONE]"
        assert post(url, max_tokens=3).status_code == 200  # a short one still fits its deadline
        assert runner.wait_for(lambda: not runner.running and server.engine.backend.rows == 0)


def test_a_failing_forward_fails_its_batch_only_and_the_loop_goes_on(tiny_engine, monkeypatch):
    server = Server.start(tiny_engine, method="ar", max_num_seqs=4, batch_budget=False)
    real, calls = tiny_engine.backend.verify_batch, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real(*a, **k)

    monkeypatch.setattr(tiny_engine.backend, "verify_batch", flaky)
    with Live(server) as url:
        bad = post(url, max_tokens=20)
        assert bad.status_code == 500 and "Traceback" not in bad.text and "device lost" not in bad.text
        assert bad.json()["error"]["type"] == "server_error"
        ok = post(url, max_tokens=20)
        assert ok.status_code == 200 and httpx.get(url + "/health").json()["status"] == "ok"
        assert server.engine.backend.rows == 0


# -- admission (issue 23, findings 1 and 2) ------------------------------------------------------------------------
def test_requests_that_finish_during_admission_keep_the_loop_alive(tiny_engine, monkeypatch):
    """max_tokens 1 (or a first token that hits a stop string) finishes inside add_request: the runner used to read
    ``engine.active[-1]`` then, which raised and killed the loop, or on a busy server named another request."""
    server = Server.start(tiny_engine, method="ar", max_num_seqs=4, batch_budget=False)
    solo = tiny_engine.generate("Tell me a story.", "ar", max_new_tokens=1)
    first = tiny_engine.tokenizer.decode(solo.token_ids, skip_special_tokens=True)
    gate, runner = Gate(tiny_engine, monkeypatch), server.runner
    with Live(server) as url, cf.ThreadPoolExecutor(3) as pool:
        long = pool.submit(post, url, max_tokens=60, messages=[{"role": "user", "content": "Hi"}])
        assert runner.wait_for(lambda: runner.running)  # its first step is held: it stays in the batch
        one = pool.submit(post, url, max_tokens=1)
        stopped = pool.submit(post, url, max_tokens=8, stop=[first[:1]]) if first else None
        assert runner.wait_for(lambda: len(runner.waiting) == 1 + (stopped is not None))
        gate.open()  # both are admitted beside the long one, and finish there
        one = one.result()
        assert one.status_code == 200, one.text
        assert one.json()["usage"]["prompt_tokens"] == len(solo.prompt_ids)
        assert one.json()["choices"][0]["message"]["content"] == solo.text
        if stopped is not None:
            assert stopped.result().status_code == 200
            assert stopped.result().json()["choices"][0]["finish_reason"] == "stop"
        assert long.result().status_code == 200
        assert httpx.get(url + "/health").status_code == 200 and runner.alive


def test_a_request_failing_after_its_prefill_leaves_no_row(tiny_engine, monkeypatch):
    """An error after the row is added (the generator, the first token) used to leave the row decoding to
    max_tokens, uncounted; now admission is all or nothing and the error is this request's alone."""
    server = Server.start(tiny_engine, method="ar", max_num_seqs=4, batch_budget=False)
    real = engine_mod.first_token

    def first_token(logits, params, gen):
        if params.seed == 99:
            raise RuntimeError("probabilities contain NaN")
        return real(logits, params, gen)

    monkeypatch.setattr(engine_mod, "first_token", first_token)
    gate = Gate(tiny_engine, monkeypatch)  # a row left behind would be held here, in the batch
    with Live(server) as url:
        bad = post(url, max_tokens=50, temperature=0.5, seed=99)
        assert bad.status_code == 500 and "NaN" not in bad.text
        assert not tiny_engine.active and tiny_engine.backend.rows == 0 and not server.runner.running
        gate.open()
        for extreme in ({"seed": 2**64}, {"temperature": 1e-39}):  # pass no longer: a 400 naming the field
            r = post(url, max_tokens=50, **extreme)
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extreme)), r.text
        assert post(url, max_tokens=4).status_code == 200
        assert tiny_engine.backend.rows == 0 and server.runner.alive


def test_a_dead_loop_answers_503_at_once_and_fails_health(tiny_engine, monkeypatch):
    server = Server.start(tiny_engine, method="ar", max_num_seqs=2, batch_budget=False)

    def broken(outs):
        raise RuntimeError("a bug in delivery")

    monkeypatch.setattr(server.runner, "_deliver", broken)
    with Live(server) as url:
        first = post(url, max_tokens=4)
        assert first.status_code == 500
        assert "a bug" not in first.text
        assert server.runner.wait_for(lambda: not server.runner.alive)
        r = httpx.post(url + "/v1/chat/completions", json={**BODY, "max_tokens": 4}, timeout=10)
        # it used to queue a ticket nobody serves: the client hung (here: a ReadTimeout)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"
        assert httpx.get(url + "/health").status_code == 503


def test_running_gauge_counts_the_engines_rows(tiny_engine, monkeypatch):
    """``num_requests_running`` is the engine's rows (vLLM's meaning), so a row nobody waits for shows."""
    tiny_engine.add_request("A row the server does not know about.", "ar", max_new_tokens=40)
    gate = Gate(tiny_engine, monkeypatch)
    server = Server.start(tiny_engine, method="ar", max_num_seqs=2, batch_budget=False, warm=False)
    runner = server.runner
    with Live(server) as url:
        turns = runner.turns
        gate.allow(1)  # one step of the orphan row; the next one waits at the gate
        assert runner.wait_for(lambda: runner.turns > turns)
        text = httpx.get(url + "/metrics").text
        running = next(float(x.split()[-1]) for x in text.splitlines()
                       if x.startswith("specgraft:num_requests_running{"))
        assert not runner.running and len(tiny_engine.active) == 1 and running == 1
        gate.open()
        assert runner.wait_for(lambda: not tiny_engine.active)


# -- reservation (finding 4), generic part: a request that does not fit beside the others waits ----------------
def test_a_request_that_does_not_fit_beside_the_running_ones_waits(tiny_engine, monkeypatch):
    """A backend whose shared resource (here 200 "cells") holds one such request at a time: the second waits
    in the queue, first in line, and runs once the first finishes; one that can never fit gets a 400."""
    backend = tiny_engine.backend
    monkeypatch.setattr(backend, "capacity", lambda: {"cells": 200})
    monkeypatch.setattr(backend, "reservation", lambda p, n, b: {"cells": p + n + b + 1})
    server = Server.start(tiny_engine, method="ar", max_num_seqs=4, batch_budget=False, warm=False)
    gate, runner = Gate(tiny_engine, monkeypatch), server.runner
    with Live(server) as url, cf.ThreadPoolExecutor(2) as pool:
        a = pool.submit(post, url, max_tokens=100)
        assert runner.wait_for(lambda: len(runner.running) == 1)
        b = pool.submit(post, url, max_tokens=100)  # fits alone, not beside the first
        assert runner.wait_for(lambda: len(runner.waiting) == 1)
        gate.allow(1)
        assert runner.wait_for(lambda: runner.deferred >= 1)
        assert len(runner.running) == 1 and len(runner.waiting) == 1 and len(tiny_engine.active) == 1
        gate.open()
        assert a.result().status_code == 200 and b.result().status_code == 200
        never = post(url, max_tokens=180)  # more than the whole capacity: a 400, not a wait
        assert never.status_code == 400 and "never fit" in never.json()["error"]["message"]


def test_stop_ends_the_loop_aborts_what_is_in_flight_and_gives_the_engine_back(tiny_engine, monkeypatch):
    """An engine outlives its server (tools and tests start several on one engine): ``Server.stop`` ends the
    engine loop, aborts a request still in the engine and restores the engine's own budget policy (not the
    server's, and not None)."""
    def own(req, batch):
        return req.budget

    monkeypatch.setattr(tiny_engine, "budget_policy", own)
    monkeypatch.setattr(app_mod, "BatchBudget", lambda engine: "the server's policy")  # no curve to measure here
    server = Server.start(tiny_engine, method="ar", max_num_seqs=2, warm=False)
    assert tiny_engine.budget_policy == "the server's policy" and server.runner.alive
    server.runner.stop()  # the idle loop ends without a step, so the request below stays in the engine
    rid = tiny_engine.add_request("Tell me a story.", "ar", max_new_tokens=100)
    assert [r.id for r in tiny_engine.active] == [rid]
    server.stop()
    assert not server.runner.alive and not tiny_engine.active and not tiny_engine.has_unfinished()
    assert tiny_engine.budget_policy is own


# -- --method auto under load (issue 27): a request the policy would give no tree runs as AR -----------------------
def test_auto_requests_joining_a_batch_that_leaves_them_no_tree_run_as_ar(tiny_engine, monkeypatch):
    """On a ``--method auto`` server, a greedy request that names no method is admitted as AR when the budget
    policy gives its method no tree at the batch it joins (here PLD on a curve whose knee is 4 slots: no tree
    from 3 requests on). Alone it keeps its method; a request naming its method, and a sampled one, keep it
    under any load. Every greedy text is AR's."""
    from specgraft.serve.policy import BatchBudget

    def policy(engine):
        p = BatchBudget.__new__(BatchBudget)
        p.curve, p.knee, p.model, p._cal, p._memo = {1: 0.1, 2: 0.1, 4: 0.1, 8: 0.5, 64: 4.0}, 4, "m", {}, {}
        return p

    monkeypatch.setattr(app_mod, "BatchBudget", policy)
    auto = {"method": "pld", "budget": 10, "reason": "test"}
    server = Server.start(tiny_engine, method="pld", budget=10, auto=auto, max_num_seqs=4, warm=False)
    assert tiny_engine.budget_policy.budget_for({"method": "pld"}, 10, 3) == 0  # the premise
    gate, runner = Gate(tiny_engine, monkeypatch), server.runner
    chat = {"messages": BODY["messages"], "temperature": 0, "max_tokens": 24}
    try:
        with Live(server) as url, cf.ThreadPoolExecutor(5) as pool:
            def send(**extra):
                sent = pool.submit(httpx.post, url + "/v1/chat/completions", json={**chat, **extra}, timeout=60)
                return sent

            alone = send()
            assert runner.wait_for(lambda: len(runner.running) == 1)  # admitted alone, its first step held
            sent = {}
            for k, (name, extra) in enumerate((("c1", {}), ("c2", {}), ("named", {"method": "pld"}),
                                               ("sampled", {"temperature": 0.7, "seed": 3}))):
                sent[name] = send(**extra)  # queued in this order while the first step is held
                assert runner.wait_for(lambda: len(runner.waiting) == k + 1)
            gate.open()
            got = {"alone": alone.result().json(), **{n: f.result().json() for n, f in sent.items()}}
            shed = next(float(x.split()[-1]) for x in httpx.get(url + "/metrics").text.splitlines()
                        if x.startswith("specgraft:spec_decode_requests_shed_total{"))
    finally:
        server.stop()
    ran = {name: r["specgraft"]["method"] for name, r in got.items()}
    assert ran == {"alone": "pld", "c1": "ar", "c2": "ar", "named": "pld", "sampled": "pld"}
    assert got["c1"]["specgraft"]["shed_from"] == "pld" and "shed_from" not in got["alone"]["specgraft"]
    assert shed == 2
    ar = tiny_engine.generate(BODY["messages"], "ar", max_new_tokens=24).text
    assert {got[n]["choices"][0]["message"]["content"] for n in ("alone", "c1", "c2", "named")} == {ar}


def test_only_auto_greedy_requests_with_a_tree_budget_can_be_shed(tiny_engine, monkeypatch):
    """``Server.speculation_test``: None (never shed) for an explicit ``--method`` server, a server without the
    budget policy, AR, sampling, a budget still "auto" and budget 0; a test of the batch otherwise."""
    from types import SimpleNamespace

    from specgraft.core.sampling import SamplingParams

    monkeypatch.setattr(tiny_engine, "budget_policy", SimpleNamespace(budget_for=lambda c, b, n: b if n < 3 else 0))
    server = Server(tiny_engine, runner=None, metrics=None, name="t", method="pld", auto={"method": "pld"})
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.7)

    def test(**kw):
        return server.speculation_test(SimpleNamespace(**{"method": "pld", "sampling": greedy, "budget": 10,
                                                           "options": {}, **kw}))

    pays = test()
    assert pays(2) and not pays(3)
    assert test(method="ar") is None and test(sampling=sampled) is None
    assert test(budget="auto") is None and test(budget=0) is None
    server.auto = None
    assert test() is None
    server.auto = {"method": "pld"}
    monkeypatch.setattr(tiny_engine, "budget_policy", None)  # --no-batch-budget
    assert test() is None
