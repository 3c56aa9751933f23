"""The OpenAI-compatible server on real HTTP: the official openai client, error envelopes, continuous batching
(greedy outputs equal solo outputs, seeded sampling independent of neighbours), cancellation, metrics."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from openai import OpenAI

from specgraft.core.sampling import SamplingParams
from specgraft.serve.app import Server

from ..conftest import assert_greedy_equal
from ..test_smollm2 import PROMPTS
from .live import Live

MIXED = [("ar", {}), ("pld", {}), ("recycle", {}), ("eagle", {}), ("graft", {}), ("graft", {"budget": 15})]
N_TOK = 32


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def metric(text: str, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


@pytest.fixture(scope="module")
def smol(smollm2_engine):
    """SmolLM2 fp32 behind a live server (default method graft, 8 in a batch), with solo AR references."""
    engine = smollm2_engine
    solo = {p: engine.generate(p, "ar", max_new_tokens=N_TOK) for p in PROMPTS}
    raw = engine.generate("The three primary colours are", "ar", max_new_tokens=24, chat=False)
    seeded = engine.generate(PROMPTS[5], "graft", max_new_tokens=32, sampling=SamplingParams(0.8, seed=7))
    server = Server.start(engine, method="graft", max_num_seqs=8, max_queue=128)
    with Live(server) as url:
        yield SimpleNamespace(url=url, server=server, engine=engine, solo=solo, raw=raw, seeded=seeded)


@pytest.mark.slow
def test_openai_client_chat_and_completions(smol):
    c = client(smol.url)
    ref = smol.solo[PROMPTS[0]]
    r = c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": PROMPTS[0]}],
                                  temperature=0, max_tokens=N_TOK)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == len(ref.prompt_ids)
    spec = r.usage.model_extra["specgraft"]
    assert spec["method"] == "graft" and spec["lossy"] is False and spec["steps"] >= 1
    assert spec["mean_accepted_tokens"] == pytest.approx(len(ref.token_ids) - 1, rel=1) and \
        spec["mean_accepted_tokens"] >= 1.0

    chunks = list(c.chat.completions.create(model="smollm2-135m", stream=True, temperature=0, max_tokens=N_TOK,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": PROMPTS[0]}]))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    assert all(ch.usage is None for ch in chunks[:-1])

    r = c.completions.create(model="smollm2-135m", prompt="The three primary colours are", temperature=0,
                             max_tokens=24, extra_body={"method": "pld"})
    assert r.choices[0].text == smol.raw.text and r.usage.model_extra["specgraft"]["method"] == "pld"
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model="smollm2-135m", prompt="The three primary colours are", temperature=0, max_tokens=24, stream=True))
    assert text == smol.raw.text
    assert [m.id for m in c.models.list().data] == ["smollm2-135m"]


@pytest.mark.slow
def test_bad_requests_get_openai_errors_and_harm_nobody(smol):
    url, ok = smol.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    cases = [
        ('{"messages": [', 400, None),
        (json.dumps({**ok, "max_tokens": "many"}), 400, "max_tokens"),
        (json.dumps({**ok, "temperature": [1]}), 400, "temperature"),
        (json.dumps({**ok, "max_tokens": -5}), 400, "max_tokens"),
        (json.dumps({**ok, "model": "gpt-4o"}), 404, "model"),
        (json.dumps({"messages": []}), 400, "messages"),
        (json.dumps({"messages": [{"role": "user", "content": "  "}]}), 400, "messages"),
        (json.dumps({**ok, "n": 2}), 400, "n"),
        (json.dumps({**ok, "logprobs": True}), 400, "logprobs"),
        (json.dumps({**ok, "tools": [{"type": "function"}]}), 400, "tools"),
        (json.dumps({**ok, "method": "nope"}), 400, "method"),
        (json.dumps({**ok, "verify": "lossy:typical:0.3", "temperature": 0}), 400, None),
        (json.dumps({"messages": [{"role": "user", "content": "word " * 200_000}]}), 400, "messages"),  # ~1 MB
    ]
    with cf.ThreadPoolExecutor(1) as pool:  # a good request in flight while the bad ones arrive
        good = pool.submit(httpx.post, url, json={**ok, "temperature": 0, "max_tokens": N_TOK,
                                                  "messages": [{"role": "user", "content": PROMPTS[0]}]},
                           timeout=300)
        for body, status, param in cases:
            r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
            assert r.status_code == status, (body[:80], r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            assert "Traceback" not in r.text and (param is None or err["param"] == param), (body[:80], err)
        assert good.result().json()["choices"][0]["message"]["content"] == smol.solo[PROMPTS[0]].text
    big = httpx.post(url, content=cases[-1][0], headers={"content-type": "application/json"}, timeout=60).json()
    assert re.search(r"maximum context length is 8192 tokens.*\d+ in the prompt", big["error"]["message"])
    assert big["error"]["code"] == "context_length_exceeded"
    assert httpx.get(smol.url + "/v1/nowhere").json()["error"]["message"]
    assert httpx.get(smol.url + "/health").json()["status"] == "ok"


@pytest.mark.slow
def test_sixteen_concurrent_mixed_greedy_requests_equal_solo(smol):
    """16 requests, 6 methods, 8 running at a time (8 queue): each returns its solo AR output (fp32, tie rule)."""
    jobs = [(PROMPTS[i % 8], *MIXED[i % len(MIXED)]) for i in range(16)]

    def one(job):
        prompt, method, opts = job
        body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": N_TOK,
                "method": method, "return_token_ids": True, **opts}
        return httpx.post(smol.url + "/v1/chat/completions", json=body, timeout=600).json()

    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, jobs))
    for (prompt, method, _), r in zip(jobs, results):
        choice, ref = r["choices"][0], smol.solo[prompt]
        out = SimpleNamespace(token_ids=choice["token_ids"], prompt_ids=ref.prompt_ids)
        if not assert_greedy_equal(smol.engine, ref, out, f"served {method}"):
            assert choice["message"]["content"] == ref.text
        assert r["usage"]["specgraft"]["method"] == method


@pytest.mark.slow
def test_seeded_sampling_is_the_same_whatever_runs_beside_it(smol):
    body = {"messages": [{"role": "user", "content": PROMPTS[5]}], "temperature": 0.8, "seed": 7, "max_tokens": 32,
            "method": "graft"}
    url = smol.url + "/v1/chat/completions"
    others = [{"messages": [{"role": "user", "content": p}], "temperature": 0.9, "seed": s, "max_tokens": 40,
               "method": m} for s, (p, (m, _)) in enumerate(zip(PROMPTS, MIXED))]
    runner = smol.server.runner
    joined = {}

    def mine_joined_a_running_batch():  # evaluated after each loop turn: mine admitted while others decode
        seeds = [t.kwargs["sampling"].seed for t in list(runner.running.values())]
        if 7 in seeds and len(seeds) > 1:
            joined["beside"] = len(seeds) - 1
        return "beside" in joined

    with cf.ThreadPoolExecutor(7) as pool:
        crowd = [pool.submit(httpx.post, url, json=o, timeout=600) for o in others]
        assert runner.wait_for(lambda: len(runner.running) >= 6)  # the crowd is decoding
        mine = pool.submit(httpx.post, url, json=body, timeout=600)
        assert runner.wait_for(mine_joined_a_running_batch)
        assert all(f.result().status_code == 200 for f in crowd)
        text = mine.result().json()["choices"][0]["message"]["content"]
    assert joined["beside"] >= 1 and text == smol.seeded.text


@pytest.mark.slow
def test_client_disconnect_mid_stream_frees_the_row(smol):
    before = metric(httpx.get(smol.url + "/metrics").text, "specgraft:request_success_total", finished_reason="abort")
    body = {"messages": [{"role": "user", "content": PROMPTS[1]}], "temperature": 0, "max_tokens": 400,
            "stream": True}
    with httpx.stream("POST", smol.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert all(x.startswith("data: ") or x == "" for x in got)
    runner = smol.server.runner
    assert runner.wait_for(lambda: not runner.running and not smol.engine.active, timeout=60)
    assert smol.engine.backend.rows == 0
    after = metric(httpx.get(smol.url + "/metrics").text, "specgraft:request_success_total", finished_reason="abort")
    assert after == before + 1


@pytest.mark.slow
def test_thirty_two_concurrent_streaming_clients_zero_errors(smol):
    c = client(smol.url)
    errors, texts = [], []
    lock = threading.Lock()

    def one(i):
        try:
            stream = c.chat.completions.create(model="smollm2-135m", stream=True, max_tokens=8, temperature=0.7,
                                               seed=i, messages=[{"role": "user", "content": PROMPTS[i % 8]}],
                                               extra_body={"method": MIXED[i % len(MIXED)][0]})
            chunks = list(stream)
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
            with lock:
                texts.append(("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), finish))
        except Exception as err:  # noqa: BLE001 -- counted, then asserted to be zero
            with lock:
                errors.append(repr(err))

    with cf.ThreadPoolExecutor(32) as pool:
        list(pool.map(one, range(32)))
    assert errors == [] and len(texts) == 32
    assert all(t and f in ("stop", "length") for t, f in texts)


@pytest.mark.slow
def test_metrics_use_vllm_names_and_add_up(smol):
    c = client(smol.url)
    c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": PROMPTS[2]}],
                              temperature=0, max_tokens=N_TOK)
    text = httpx.get(smol.url + "/metrics").text
    name = "specgraft:spec_decode_num_"
    drafts, drafted = metric(text, name + "drafts_total"), metric(text, name + "draft_tokens_total")
    accepted = metric(text, name + "accepted_tokens_total")
    assert drafts > 0 and drafted >= drafts and 0 < accepted <= drafted
    assert metric(text, name + "accepted_tokens_per_pos_total") == accepted
    assert metric(text, name + "accepted_tokens_per_pos_total", position="0") >= \
        metric(text, name + "accepted_tokens_per_pos_total", position="1")
    by = {s: metric(text, name + "accepted_tokens_by_source_total", source=s) for s in ("head", "matrix", "context", "bonus")}
    assert by["head"] > 0 and by["bonus"] > 0 and by["head"] + by["matrix"] + by["context"] <= accepted
    served = metric(text, "specgraft:request_success_total")
    assert metric(text, "specgraft:time_to_first_token_seconds_count") >= served - \
        metric(text, "specgraft:request_success_total", finished_reason="abort")
    assert metric(text, "specgraft:e2e_request_latency_seconds_count") == served
    assert metric(text, "specgraft:generation_tokens_total") == \
        metric(text, "specgraft:inter_token_latency_seconds_count") + metric(text, "specgraft:time_to_first_token_seconds_count")
    for gauge in ("num_requests_running", "num_requests_waiting"):
        assert f"specgraft:{gauge}" in text


@pytest.mark.slow
def test_lossy_verification_is_labelled_in_the_response(smol):
    r = httpx.post(smol.url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": PROMPTS[3]}], "temperature": 0.7, "seed": 1, "max_tokens": 16,
        "method": "eagle", "verify": "lossy:typical:0.3"})
    assert r.status_code == 200, r.text
    assert r.json()["specgraft"]["lossy"] is True and r.json()["specgraft"]["verify"].startswith("lossy:typical")
    assert r.headers["X-Specgraft-Verify"].startswith("lossy:")
