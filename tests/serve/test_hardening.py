"""What a hostile client may send (issue 23, findings 3 and 9), on the tiny engine behind a live server: the
server's policy for client options, body and stop-string limits, max_tokens clamped to the context, the API key,
and /v1/models advertising only what runs."""

from __future__ import annotations

import httpx
import pytest

from specgraft.serve.app import Server
from specgraft.serve.options import ClientPolicy
from specgraft.errors import SpecgraftError

from .live import Live

CHAT = {"messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0, "max_tokens": 4}


@pytest.fixture(scope="module")
def live(tiny_engine):
    server = Server.start(tiny_engine, method="ar", max_num_seqs=4, batch_budget=False, max_body_bytes=64 << 10,
                          max_tokens=300)
    with Live(server) as url:
        yield url, server


def post(url, body, **kw):
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60, **kw)


def error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param, err
    return err


def test_clients_choose_methods_and_budgets_within_the_policy(live):
    url, server = live
    drafters = len(server.engine._drafters)
    assert server.policy.methods[:3] == ("ar", "pld", "recycle")  # the tiny model has no EAGLE head: left out
    assert "eagle" not in server.policy.methods
    error(post(url, {**CHAT, "method": "eagle"}), 400, "method")
    error(post(url, {**CHAT, "method": "llama_pld"}), 400, "method")
    error(post(url, {**CHAT, "method": "hf_assisted"}), 400, "method")
    error(post(url, {**CHAT, "method": "draft", "budget": 8000}), 400)
    error(post(url, {**CHAT, "method": "pld", "budget": 129}), 400, "budget")
    for options in ({"k": 100000}, {"head": "/etc"}, {"matrix": "/root/.ssh/id_rsa"}, {"max_ngram": 2}):
        method = "recycle" if "k" in options else "pld"
        err = error(post(url, {**CHAT, "method": method, "options": options}), 400, "options")
        assert "/etc" not in err["message"] and "/root" not in err["message"]
    assert post(url, {**CHAT, "method": "recycle", "budget": 16}).status_code == 200
    assert len(server.engine._drafters) == drafters  # no request built a drafter
    models = httpx.get(url + "/v1/models").json()["data"][0]["specgraft"]
    assert models["methods"] == list(server.policy.methods) and "llama_pld" not in models["methods"]
    assert models["max_budget"] == 128


def test_trusted_option_keys_still_check_values(tiny_engine):
    policy = ClientPolicy.parse("ar,pld", 32, "max_ngram")
    server = Server.start(tiny_engine, method="ar", batch_budget=False, policy=policy, warm=False)
    with Live(server) as url:
        assert post(url, {**CHAT, "method": "pld", "options": {"max_ngram": 2}}).status_code == 200
        error(post(url, {**CHAT, "method": "pld", "options": {"nope": 1}}), 400)
        error(post(url, {**CHAT, "method": "recycle"}), 400, "method")
    with pytest.raises(SpecgraftError, match="unknown"):
        ClientPolicy.parse("ar,nope", 32, None)
    with pytest.raises(SpecgraftError, match="cannot run"):  # an operator's method list must all build
        Server.start(tiny_engine, method="ar", batch_budget=False, policy=ClientPolicy.parse("ar,eagle", 8, None))


def test_body_size_limit_is_413(live):
    url, _ = live
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (70 << 10)}]}
    error(post(url, big), 413)

    def chunks():  # no Content-Length: counted while read
        for _ in range(80):
            yield b" " * 1024
    r = httpx.post(url + "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    error(r, 413)
    assert post(url, CHAT).status_code == 200


def test_stop_strings_follow_openais_limits(live):
    url, _ = live
    error(post(url, {**CHAT, "stop": ["a", "b", "c", "d", "e"]}), 400, "stop")
    error(post(url, {**CHAT, "stop": ["x" * 257]}), 400, "stop")
    assert post(url, {**CHAT, "stop": ["a", "b", "c", "x" * 256]}).status_code == 200


def test_max_tokens_is_clamped_to_the_context_when_unset(live, tiny_engine):
    url, server = live
    limit = tiny_engine.backend.max_positions  # 256 for the tiny model; the server's default is 300
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    r = post(url, {**body, "method": "ar", "return_token_ids": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] + 1 <= limit
    err = error(post(url, {**CHAT, "max_tokens": 400}), 400)
    assert err["code"] == "context_length_exceeded" and "400 for the completion" in err["message"]


def test_api_key_guards_v1_only(tiny_engine, monkeypatch):
    monkeypatch.setenv("SPECGRAFT_API_KEY", "s3cret")
    server = Server.start(tiny_engine, method="ar", batch_budget=False, warm=False)
    with Live(server) as url:
        assert error(post(url, CHAT), 401)["code"] == "invalid_api_key"
        error(post(url, CHAT, headers={"Authorization": "Bearer wrong"}), 401)
        error(httpx.get(url + "/v1/models"), 401)
        assert post(url, CHAT, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        from openai import AuthenticationError, OpenAI

        ok = OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.chat.completions.create(model=server.name, messages=CHAT["messages"], max_tokens=2).choices
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
        assert httpx.get(url + "/health").status_code == 200  # a supervisor's probe needs no key
