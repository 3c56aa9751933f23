"""Load generator for ``specgraft serve``: closed-loop streaming clients at fixed concurrency.

One run measures every (concurrency, method) cell against the same server: rounds x concurrencies x methods,
the method order rotated by one place per round and per concurrency (:func:`cell_order`: no method always runs
first), after a warm-up request on a prompt outside
the evaluation set. Each cell sends its prompts through ``concurrency`` clients, each starting its next request
when the previous one ends. Per request: time to first token (first streamed token), inter-token latency (a
chunk's gap shared by the tokens it carries: one value per token), end-to-end latency, tokens, errors.
Records (one JSON line per request) make the run resumable; :func:`summary` and :func:`table` aggregate them.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import numpy as np

from .harness import parse_method, rotated
from .report_stats import ratio_of_ratios

WARMUP_PROMPT = "Write two sentences about lighthouses."  # in no dataset we evaluate on


def request_body(spec: str, prompt: str, max_tokens: int) -> dict:
    """``"graft:budget=7"`` -> the request's method, budget and options (greedy, fixed length). ``"auto"``
    names no method: the server's default, i.e. its ``--method auto`` choice when started with it."""
    opts = parse_method(spec)
    method, budget = opts.pop("name"), opts.pop("budget", None)
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if method != "auto":
        body["method"] = method
    if budget is not None:
        body["budget"] = budget
    if opts:
        body["options"] = opts
    return body


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    first, last, gaps, tokens, err, usage = None, None, [], 0, None, None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}", "e2e_s": time.perf_counter() - t0}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    err = chunk["error"]["message"]
                    break
                usage = chunk.get("usage") or usage
                seen = (chunk.get("specgraft") or {}).get("tokens")
                if seen is None or seen <= tokens:
                    continue
                now, new = time.perf_counter(), seen - tokens
                if first is None:  # the first visible token: TTFT (tokens released with it have no gap of their own)
                    first = now - t0
                else:
                    gaps += [(now - last) / new] * new
                tokens, last = seen, now
    except httpx.HTTPError as e:
        err = f"{type(e).__name__}: {e}"
    spec = (usage or {}).get("specgraft") or {}
    return {"e2e_s": time.perf_counter() - t0, "ttft_s": first, "itl_s": gaps, "tokens": tokens,
            "steps": spec.get("steps"), "ran": spec.get("method"), "shed_from": spec.get("shed_from"), "error": err}


async def run_cell(url: str, spec: str, prompts: list[tuple[str, str]], concurrency: int, max_tokens: int
                   ) -> tuple[list[dict], float]:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    out: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1200.0), limits=limits) as client:
        async def worker():
            while not queue.empty():
                pid, prompt = queue.get_nowait()
                rec = await stream_one(client, url, request_body(spec, prompt, max_tokens))
                out.append({"prompt": pid, **rec})

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return out, wall


def run_loadtest(url: str, specs: list[str], prompts: list[tuple[str, str]], concurrencies: list[int], rounds: int,
                 max_tokens: int, out_path: str | Path, meta: dict, log=print) -> list[dict]:
    """Every (round, concurrency, method) cell once, in :func:`cell_order`; resumes from ``out_path``."""
    out_path = Path(out_path)
    done = {(r["round"], r["concurrency"], r["method"]) for r in read(out_path) if r.get("kind") == "cell"}
    asyncio.run(stream_one_warm(url, specs, max_tokens))
    for rnd, c, spec in cell_order(specs, concurrencies, rounds):
        if (rnd, c, spec) in done:
            continue
        reqs, wall = asyncio.run(run_cell(url, spec, prompts, c, max_tokens))
        base = {**meta, "round": rnd, "concurrency": c, "method": spec}
        with out_path.open("a") as f:
            for r in reqs:
                f.write(json.dumps({**base, "kind": "request", **r}) + "\n")
            f.write(json.dumps({**base, "kind": "cell", "wall_s": wall, "requests": len(reqs),
                                "tokens": sum(r.get("tokens") or 0 for r in reqs),
                                "errors": sum(r["error"] is not None for r in reqs)}) + "\n")
        log(f"round {rnd} c={c} {spec}: {sum(r.get('tokens') or 0 for r in reqs) / wall:.2f} tok/s, "
            f"{len(reqs) / wall:.3f} req/s, errors {sum(r['error'] is not None for r in reqs)}")
    return read(out_path)


def cell_order(specs: list[str], concurrencies: list[int], rounds: int) -> list[tuple[int, int, str]]:
    """``(round, concurrency, method)`` in the order they run: the methods of round ``r``'s ``i``-th concurrency
    rotated by ``r + i`` places, so each concurrency's cells change their leading method every round (the machine's
    speed drifts over minutes: a method always run first would carry that drift into every ratio)."""
    return [(rnd, c, spec) for rnd in range(rounds) for i, c in enumerate(concurrencies)
            for spec in rotated(specs, rnd + i)]


async def stream_one_warm(url: str, specs: list[str], max_tokens: int) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(1200.0)) as client:
        for spec in specs:
            await stream_one(client, url, request_body(spec, WARMUP_PROMPT, min(max_tokens, 32)))


def read(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a half-written last line from an interrupted run
            continue
    return rows


def _pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def summary(records: list[dict]) -> list[dict]:
    """Per (model, concurrency, method): throughput over all rounds, latency percentiles, errors; against ``ar``
    the aggregate throughput ratio (tokens / wall of the cells) and the per-request speedup (AR's end-to-end
    time per token over the method's, summed over requests paired by prompt and round) with a bootstrap 95%
    interval over those pairs. With c clients busy all the time, the two agree up to the cells' tails."""
    cells = [r for r in records if r.get("kind") == "cell"]
    reqs = [r for r in records if r.get("kind") == "request"]
    rows = []
    for model, c, m in sorted({(r.get("model"), r["concurrency"], r["method"]) for r in cells},
                              key=lambda k: (str(k[0]), k[1], k[2] != "ar", k[2])):
        cs = [r for r in cells if (r.get("model"), r["concurrency"], r["method"]) == (model, c, m)]
        rs = [r for r in reqs if (r.get("model"), r["concurrency"], r["method"]) == (model, c, m)]
        ok = [r for r in rs if r["error"] is None]
        wall, tokens = sum(x["wall_s"] for x in cs), sum(x["tokens"] for x in cs)
        steps = sum(r.get("steps") or 0 for r in ok)
        rows.append({"model": model, "concurrency": c, "method": m, "rounds": len(cs), "requests": len(rs),
                     "req_per_s": len(rs) / wall, "tok_per_s": tokens / wall,
                     "round_tok_per_s": [x["tokens"] / x["wall_s"] for x in cs],
                     "ttft_p50": _pct([r["ttft_s"] for r in ok if r["ttft_s"] is not None], 50),
                     "ttft_p99": _pct([r["ttft_s"] for r in ok if r["ttft_s"] is not None], 99),
                     "itl_p50": _pct([g for r in ok for g in r["itl_s"]], 50),
                     "itl_p99": _pct([g for r in ok for g in r["itl_s"]], 99),
                     "mat": (sum(r["tokens"] - 1 for r in ok) / steps) if steps else None,
                     "shed": sum(1 for r in ok if r.get("shed_from")),  # --method auto requests run as AR
                     "errors": len(rs) - len(ok)})
    for row in rows:
        ar = next((x for x in rows if (x["model"], x["concurrency"], x["method"]) == (row["model"], row["concurrency"], "ar")), None)
        if ar is None:
            continue
        row["throughput_ratio"] = row["tok_per_s"] / ar["tok_per_s"]
        key = lambda r: (r["round"], r["prompt"])  # noqa: E731
        a = {key(r): r for r in reqs if (r.get("model"), r["concurrency"], r["method"]) ==
             (row["model"], row["concurrency"], "ar") and r["error"] is None}
        b = {key(r): r for r in reqs if (r.get("model"), r["concurrency"], r["method"]) ==
             (row["model"], row["concurrency"], row["method"]) and r["error"] is None}
        ks = sorted(set(a) & set(b), key=str)
        est = ratio_of_ratios([a[k]["e2e_s"] for k in ks], [a[k]["tokens"] for k in ks],
                              [b[k]["e2e_s"] for k in ks], [b[k]["tokens"] for k in ks])
        row["speedup"], row["speedup_ci"] = est.point, [est.lo, est.hi]
    return rows


def table(rows: list[dict]) -> str:
    head = ("| model | conc. | method | req/s | tok/s (per round) | throughput vs AR | per-request speedup "
            "[95% CI] | TTFT p50 / p99 s | ITL p50 / p99 ms | MAT | errors |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        tr = f"{r['throughput_ratio']:.2f}x" if "throughput_ratio" in r else "-"
        ci = f"{r['speedup']:.2f}x [{r['speedup_ci'][0]:.2f}, {r['speedup_ci'][1]:.2f}]" if "speedup" in r else "-"
        per = ", ".join(f"{x:.1f}" for x in r["round_tok_per_s"])
        mat = (f"{r['mat']:.2f}" if r["mat"] else "-") + (f" ({r['shed']} shed to AR)" if r.get("shed") else "")
        lines.append(f"| {r['model']} | {r['concurrency']} | {r['method']} | {r['req_per_s']:.3f} | "
                     f"{r['tok_per_s']:.2f} ({per}) | {tr} | {ci} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
                     f"{1000 * r['itl_p50']:.0f} / {1000 * r['itl_p99']:.0f} | {mat} | {r['errors']} |")
    return "\n".join(lines)


def prompt_table(records: list[dict], concurrency: int) -> str:
    """Per prompt at one concurrency: each method's end-to-end seconds per token (mean over rounds) and its
    speedup over AR on that prompt, so a total is never the only evidence."""
    reqs = [r for r in records if r.get("kind") == "request" and r["concurrency"] == concurrency
            and r["error"] is None and r.get("tokens")]
    methods = sorted({r["method"] for r in reqs}, key=lambda m: (m != "ar", m))
    prompts = sorted({r["prompt"] for r in reqs}, key=lambda p: (len(p), p))
    spt = {(m, p): float(np.mean([r["e2e_s"] / r["tokens"] for r in reqs if (r["method"], r["prompt"]) == (m, p)]))
           for m in methods for p in prompts if any((r["method"], r["prompt"]) == (m, p) for r in reqs)}
    lines = ["| prompt | " + " | ".join(f"{m} s/token" + ("" if m == "ar" else " (vs AR)") for m in methods) + " |",
             "|---|" + "---|" * len(methods)]
    for p in prompts:
        cells = []
        for m in methods:
            v = spt.get((m, p))
            ar = spt.get(("ar", p))
            cells.append("-" if v is None else f"{v:.3f}" + ("" if m == "ar" or not ar else f" ({ar / v:.2f}x)"))
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
