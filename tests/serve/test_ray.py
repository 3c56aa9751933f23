"""specgraft on Ray Serve: two SmolLM2 replicas behind Serve's proxy, exact outputs, a replica killed.

A local Ray of 2 CPUs; each replica reserves 1 CPU, loads SmolLM2-135M (float32) and serves method graft.
"""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'specgraft[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'specgraft[ray]')")
openai = pytest.importorskip("openai", reason="the openai client is not installed")

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
           "Explain what a CPU does in one sentence."]
MAX_TOKENS = 24
APP = "specgraft"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replicas() -> dict[str, int]:
    """Live replica actors of our deployment: actor name -> pid (asked inside the actor: no dashboard needed)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{APP}#")]
    out = {}
    for name in names:
        try:
            handle = ray.get_actor(name, namespace="serve")
            out[name] = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        except Exception:  # noqa: BLE001 -- an actor that just died: not live
            continue
    return out


@pytest.fixture(scope="module")
def solo(smollm2_engine):
    """Each prompt alone, AR, greedy: what every replica must answer (the server applies the chat template to
    chat messages, as Engine.generate does to a string prompt)."""
    return {p: smollm2_engine.generate(p, "ar", max_new_tokens=MAX_TOKENS).text for p in PROMPTS}


@pytest.fixture(scope="module")
def cluster(solo):
    from specgraft.serve.ray import deployment

    port = _free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment({"model": "smollm2-135m", "method": "graft", "dtype": "float32"}, replicas=2,
                             num_cpus=1), name=APP, route_prefix="/")
        # max_retries=0: a failed request is a failure, not silently retried by the client
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _ask(client, prompt: str) -> tuple[str, str]:
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2-135m", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=MAX_TOKENS)
    completion = raw.parse()
    replica = raw.headers["x-specgraft-replica"]
    assert completion.usage.model_extra["specgraft"]["replica"] == replica
    return replica, completion.choices[0].message.content


def _ask_all(client, prompts: list[str]) -> list[tuple[str, str]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _ask(client, p), prompts))


def test_two_replicas_serve_exact_outputs(cluster, solo):
    live = _replicas()
    assert len(live) == 2, live
    prompts = PROMPTS * 2  # 8 concurrent requests
    results = _ask_all(cluster, prompts)
    for prompt, (_, text) in zip(prompts, results):
        assert text == solo[prompt], prompt
    served = {replica for replica, _ in results}
    # both replicas served, and they are the two replica actors (host:pid)
    assert {int(r.rsplit(":", 1)[1]) for r in served} == set(live.values()), (served, live)


def test_survives_a_killed_replica(cluster, solo):
    """After ray.kill of one replica actor (no restart): within 120 s Serve's controller reports the deployment
    HEALTHY with 2 RUNNING replicas again, none of them the killed actor (a replacement was started). Then 4
    concurrent new requests (client retries off) all succeed with the solo outputs, and none of them is served by
    the killed process. Requests sent in the seconds right after the kill are not asserted: one routed to the dead
    replica before the proxy learns of its death may fail."""
    before = _replicas()
    victim, victim_pid = sorted(before.items())[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    deadline, live = time.monotonic() + 120, {}
    while time.monotonic() < deadline:
        dep = serve.status().applications[APP].deployments["SpecgraftDeployment"]
        live = _replicas()
        healthy = getattr(dep.status, "value", dep.status) == "HEALTHY"
        if healthy and dep.replica_states.get("RUNNING") == 2 and len(live) == 2 and victim not in live:
            break
        time.sleep(1)
    else:
        pytest.fail(f"no recovery within 120 s: {serve.status().applications[APP].deployments}, live {live}")
    results = _ask_all(cluster, PROMPTS)
    for prompt, (_, text) in zip(PROMPTS, results):
        assert text == solo[prompt], prompt
    pids = {int(replica.rsplit(":", 1)[1]) for replica, _ in results}
    assert victim_pid not in pids and pids <= set(live.values()), (pids, victim_pid, live)
