"""Property-based requests against a live server, next to a steady stream of good greedy requests (issue 23).

Bodies come from the OpenAPI schema FastAPI serves (``hypothesis-jsonschema``), mixed with malformed JSON, wrong
types, huge fields and random bytes; they go to both completion endpoints, streamed or not. The properties:
no 5xx, the engine loop alive, no rows left in the engine afterwards, and every good request's text equal to
its solo text (greedy fp32: batching never changes an output).

    python -m tests.serve.fuzz --requests 5000 --out docs/data/fuzz-smollm2.json   # the long run (docs/serving.md)

``tests/serve/test_fuzz.py`` runs a bounded count of it in CI.
"""

from __future__ import annotations

import argparse
import collections
import json
import threading
import time

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

ENDPOINTS = {"/v1/chat/completions": "ChatRequest", "/v1/completions": "CompletionRequest"}
MAX_FUZZ_TOKENS = 12  # generated lengths beyond it are folded into 1..12 (kept: those beyond the context)
GOOD_METHODS = ("ar", "pld", "recycle", "graft")


def _shorten(body):
    """Keep generated completions short (the CPU serves the good stream too); lengths past any context stay."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and MAX_FUZZ_TOKENS < v < 100_000:
                body[key] = 1 + v % MAX_FUZZ_TOKENS
    return body


def plausible(chat: bool):
    """Bodies a real client could send: known fields with edge values, most of them reaching the engine."""
    text = st.text(min_size=0, max_size=40) | st.sampled_from(["Hi", "Count to five.", "é😀中", " ", "\n\n"])
    fields = {
        "max_tokens": st.integers(-1, MAX_FUZZ_TOKENS) | st.just(10**6),
        "temperature": st.sampled_from([0, 0.0, 1e-39, 1e-5, 0.7, 2.0, 2.5]),
        "top_p": st.sampled_from([0.0, 1e-9, 0.9, 1.0]),
        "top_k": st.integers(-1, 5) | st.just(10**9),
        "seed": st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64, -1]),
        "stop": st.lists(text, max_size=6) | text,
        "stream": st.booleans(),
        "method": st.sampled_from(["ar", "pld", "recycle", "eagle", "graft", "prune", "draft", "llama_pld",
                                   "hf_assisted", "nope"]),
        "budget": st.integers(-1, 140) | st.just("auto") | st.just(10**6),
        "options": st.sampled_from([{}, {"k": 100000}, {"head": "/etc"}, {"rho": 0.5}, {"depth": 10**6}]),
        "verify": st.sampled_from(["lossless", "lossy:typical:0.3", "lossy:lenience:0.5", "lossy:nope:1"]),
        "min_p": st.sampled_from([0.0, 0.1, 1.0]),
        "return_token_ids": st.booleans(),
    }
    base = {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                        "content": text}), min_size=1, max_size=3)} if chat else \
        {"prompt": text | st.lists(st.integers(-1, 60_000), max_size=8)}
    return st.fixed_dictionaries(base, optional=fields).map(_shorten)


def requests_strategy(openapi: dict):
    """(path, raw body bytes, stream?) triples: schema-valid bodies, near misses and junk."""
    comps = {"components": openapi["components"]}
    per_path = []
    for path, name in ENDPOINTS.items():
        valid = from_schema({"$ref": f"#/components/schemas/{name}", **comps}).map(_shorten)
        junk = st.one_of(
            st.dictionaries(st.sampled_from(["messages", "prompt", "max_tokens", "temperature", "stop", "seed",
                                             "method", "budget", "options", "verify", "top_p", "stream"]),
                            st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                                         lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(), c, max_size=4),
                                         max_leaves=8)),
            st.just({"messages": [{"role": "user", "content": "x" * 50_000}], "max_tokens": 2}),
            st.just({"prompt": list(range(-3, 2)), "max_tokens": 2}),
        )
        near = plausible(path.endswith("chat/completions"))
        body = st.one_of(valid, near, near, near, junk).map(lambda b: json.dumps(b).encode())
        raw = st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"{", b"[]", b"null", b'{"messages": [']))
        per_path.append(st.tuples(st.just(path), st.one_of(body, body, body, raw)))
    return st.one_of(*per_path)


def send(client: httpx.Client, path: str, content: bytes) -> int:
    """One request; the status, or for a stream that failed after its headers, the status in its error event."""
    headers = {"content-type": "application/json"}
    try:
        streamed = b'"stream": true' in content
    except TypeError:
        streamed = False
    if not streamed:
        return client.post(path, content=content, headers=headers).status_code
    with client.stream("POST", path, content=content, headers=headers) as r:
        status = r.status_code
        for line in r.iter_lines():
            if line.startswith('data: {"error"'):
                return 500 if '"server_error"' in line else 400
    return status


class Steady(threading.Thread):
    """Good greedy requests, one after another, each checked against its solo text, until stopped."""

    def __init__(self, url: str, solo: dict[str, str], max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.solo, self.max_tokens = url, solo, max_tokens
        self.halt, self.sent, self.equal, self.failures = threading.Event(), 0, 0, []

    def run(self) -> None:
        prompts = list(self.solo)
        with httpx.Client(base_url=self.url, timeout=600) as c:
            while not self.halt.is_set():
                prompt, method = prompts[self.sent % len(prompts)], GOOD_METHODS[self.sent % len(GOOD_METHODS)]
                r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                          "temperature": 0, "max_tokens": self.max_tokens,
                                                          "method": method})
                self.sent += 1
                text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
                if text == self.solo[prompt]:
                    self.equal += 1
                else:
                    self.failures.append((method, prompt, r.status_code, text))


def fuzz(url: str, openapi: dict, n: int, solo: dict[str, str], max_tokens: int, progress=None) -> dict:
    """Send ``n`` generated requests beside the steady stream; the tally (statuses, good requests)."""
    statuses: collections.Counter = collections.Counter()
    examples: dict[int, str] = {}
    steady = Steady(url, solo, max_tokens)
    steady.start()
    client = httpx.Client(base_url=url, timeout=600)

    @settings(max_examples=n, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests_strategy(openapi))
    def one(req):
        path, content = req
        status = send(client, path, content)
        statuses[status] += 1
        examples.setdefault(status, content[:300].decode(errors="replace"))
        if progress and sum(statuses.values()) % 100 == 0:
            progress(sum(statuses.values()), dict(statuses))

    t0 = time.monotonic()
    try:
        one()
    finally:
        steady.halt.set()
        steady.join()
        client.close()
    return {"requests": sum(statuses.values()), "statuses": dict(sorted(statuses.items())),
            "examples": {str(k): v for k, v in examples.items() if k >= 500},
            "good_sent": steady.sent, "good_equal_solo": steady.equal, "good_failures": steady.failures[:5],
            "wall_s": round(time.monotonic() - t0, 1)}


def main() -> None:
    """The long run: SmolLM2 fp32 behind a live server, every default method enabled."""
    from specgraft import Engine
    from specgraft.serve.app import Server, create_app

    from ..test_smollm2 import PROMPTS
    from .live import Live

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--good-tokens", type=int, default=16)
    ap.add_argument("--method", default="pld", help="the server's default method")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = Engine("smollm2-135m", "float32")
    solo = {p: engine.generate(p, "ar", max_new_tokens=args.good_tokens).text for p in PROMPTS[:4]}
    server = Server.start(engine, method=args.method, max_num_seqs=8, max_queue=128, max_tokens=MAX_FUZZ_TOKENS)
    with Live(server) as url:
        tally = fuzz(url, create_app(server).openapi(), args.requests, solo, args.good_tokens,
                     progress=lambda k, s: print(f"{k} requests: {s}", flush=True))
        import platform
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "src", "tests"], capture_output=True,
                                    text=True).stdout.strip())
        tally.update(commit=commit, dirty=dirty, cpu=platform.processor() or platform.machine(),
                     model="smollm2-135m", dtype="float32", default_method=args.method, methods=list(server.policy.methods),
                     date=time.strftime("%Y-%m-%d"))
        tally.update(loop_alive=server.runner.alive, loop_error=server.runner.error,
                     rows_left=len(engine.active) if server.runner.wait_for(lambda: not engine.active, 120)
                     else len(engine.active), backend_rows=engine.backend.rows)
    print(json.dumps(tally, indent=1))
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump(tally, f, indent=1)
        import os

        os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
