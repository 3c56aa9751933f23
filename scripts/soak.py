"""Soak test for ``specgraft serve``: many mixed requests, some aborted mid-stream; the server's resident memory
must settle (within 5% of its level after the first 100 requests). Writes one JSON line per checkpoint.

    python scripts/soak.py --requests 1000 --out docs/data/soak-smollm2.jsonl   # starts its own server

The server runs as a child process (``specgraft serve``) so its RSS is measured alone (/proc/PID/status).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPTS = ["Name three rivers in Europe.", "Write a haiku about rain.", "What is 12 times 13?",
           "Explain what a hash map is.", "List four prime numbers.", "Give a synonym for 'quick'.",
           "Write a Python function that reverses a string.", "Describe the colour blue to someone."]
METHODS = ["ar", "pld", "recycle", "graft", "eagle"]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def one(client, url, i, rng) -> str:
    body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": rng.randint(4, 32),
            "temperature": rng.choice([0, 0.7]), "seed": i, "method": rng.choice(METHODS), "stream": True}
    abort = rng.random() < 0.1
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"http {r.status_code}"
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if abort and n >= 3:
                    return "aborted"  # leaving the block closes the connection mid-stream
                if '"error"' in line:
                    return "error"
            return "ok"
    except httpx.HTTPError as e:
        return f"exc {type(e).__name__}"


async def run(url, pid, total, conc, out, log):
    rng, done, outcomes, t0 = random.Random(0), 0, {}, time.time()
    queue = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)
    peak = {"active": 0, "rss": 0.0}
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker():
            nonlocal done
            while not queue.empty():
                i = queue.get_nowait()
                res = await one(client, url, i, rng)
                outcomes[res] = outcomes.get(res, 0) + 1
                done += 1
                if done % 50 == 0:
                    health = (await client.get(url + "/health")).json()
                    row = {"requests": done, "rss_mb": round(rss_mb(pid), 1), "running": health["running"],
                           "elapsed_s": round(time.time() - t0, 1), "outcomes": dict(outcomes)}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    log(row)

        async def sampler():  # RSS with requests in flight, for the per-request cost
            while done < total:
                health = (await client.get(url + "/health")).json()
                if health["running"] >= peak["active"]:
                    peak.update(active=health["running"], rss=max(peak["rss"], rss_mb(pid)))
                await asyncio.sleep(0.5)

        await asyncio.gather(*(worker() for _ in range(conc)), sampler())
    return outcomes, peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--out", default="runs/soak.jsonl")
    a = ap.parse_args()
    url = f"http://127.0.0.1:{a.port}"
    proc = subprocess.Popen([sys.executable, "-m", "specgraft", "serve", "--model", a.model, "--method", "graft",
                             "--port", str(a.port), "--max-num-seqs", str(a.concurrency), "--log-level", "warning"])
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        idle = rss_mb(proc.pid)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "w") as out:
            out.write(json.dumps({"idle_rss_mb": round(idle, 1), "model": a.model, "concurrency": a.concurrency}) + "\n")
            outcomes, peak = asyncio.run(run(url, proc.pid, a.requests, a.concurrency, out, print))
            rows = [json.loads(x) for x in Path(a.out).read_text().splitlines()[1:]]
            base = next(r["rss_mb"] for r in rows if r["requests"] >= 100)
            final = rows[-1]["rss_mb"]
            summary = {"idle_rss_mb": idle, "rss_after_100_mb": base, "final_rss_mb": final,
                       "max_rss_after_100_mb": max(r["rss_mb"] for r in rows if r["requests"] >= 100),
                       "drift_pct": round(100 * (final - base) / base, 2), "outcomes": outcomes,
                       "peak_active": peak["active"], "peak_rss_mb": peak["rss"],
                       "rss_per_active_request_mb": round((peak["rss"] - idle) / max(peak["active"], 1), 2)}
            out.write(json.dumps({"summary": summary}) + "\n")
            print(json.dumps(summary))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
