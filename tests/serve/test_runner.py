"""The engine thread under pressure (serve/runner.py), on the tiny engine: a full queue answers 429 with
Retry-After, a deadline 504, a failing batched forward 500 for its requests only, and the loop keeps serving."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest

from specgraft.serve.app import Server

from .live import Live

BODY = {"messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0, "method": "ar"}


@pytest.fixture
def slow_engine(tiny_engine, monkeypatch):
    """Every step takes at least 20 ms, so requests overlap."""
    real = tiny_engine.step

    def step():
        time.sleep(0.02)
        return real()

    monkeypatch.setattr(tiny_engine, "step", step)
    return tiny_engine


def post(url, **body):
    return httpx.post(url + "/v1/chat/completions", json={**BODY, **body}, timeout=60)


def test_full_queue_gets_429_with_retry_after(slow_engine):
    server = Server.start(slow_engine, method="ar", max_num_seqs=1, max_queue=1, batch_budget=False)
    with Live(server) as url, cf.ThreadPoolExecutor(4) as pool:
        first = pool.submit(post, url, max_tokens=60)
        time.sleep(0.3)  # running
        second = pool.submit(post, url, max_tokens=5)
        time.sleep(0.2)  # waiting: the queue (1) is full now
        third = post(url, max_tokens=5)
        assert third.status_code == 429 and int(third.headers["Retry-After"]) >= 1
        assert third.json()["error"]["type"] == "rate_limit_error" and third.json()["error"]["code"] == "queue_full"
        assert first.result().status_code == 200 and second.result().status_code == 200


def test_no_queue_still_admits_into_a_free_slot(slow_engine):
    server = Server.start(slow_engine, method="ar", max_num_seqs=2, max_queue=0, batch_budget=False)
    with Live(server) as url:
        assert post(url, max_tokens=4).status_code == 200


def test_deadline_gives_504_and_a_stream_error_event(slow_engine):
    server = Server.start(slow_engine, method="ar", max_num_seqs=2, timeout_s=0.4, batch_budget=False)
    with Live(server) as url:
        r = post(url, max_tokens=200)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        with httpx.stream("POST", url + "/v1/chat/completions", json={**BODY, "max_tokens": 200, "stream": True},
                          timeout=60) as s:
            lines = [x for x in s.iter_lines() if x.startswith("data: ")]
        assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
        assert post(url, max_tokens=3).status_code == 200  # a short one still fits its deadline
        assert not server.runner.running and server.engine.backend.rows == 0


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
