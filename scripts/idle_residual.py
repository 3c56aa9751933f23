"""What a request whose tree the scheduler shrinks to nothing (K = 0) still costs beside AR, in the engine:
per-step time (total / verify / drafting) over a batch of greedy GSM8K requests, and admission (prefill) time,
the methods interleaved with the order alternating. Issue 27 (docs/serving.md, "Under load on an AVX-512 EPYC").

    SPECGRAFT_DATA=../shared/data python scripts/idle_residual.py --model qwen2.5-coder-1.5b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

from specgraft import Engine
from specgraft.eval.datasets import load_gsm8k


def wave(engine: Engine, prompts: list[str], method: str, budget: int, tokens: int) -> tuple[list[float], tuple]:
    """Admit every prompt (timed each), then step to the end: (admission seconds, per-step total/verify/draft)."""
    kw = {"budget": budget} if method != "ar" else {}
    admitted = []
    for p in prompts:
        start = time.perf_counter()
        engine.add_request(p, method, max_new_tokens=tokens, **kw)
        admitted.append(time.perf_counter() - start)
    engine.step()  # the first tokens
    t = engine.totals
    before = (t.total_s, t.verify_s, t.draft_s, t.steps)
    engine.run()
    steps = t.steps - before[3]
    return admitted, tuple((now - was) / steps for now, was in zip((t.total_s, t.verify_s, t.draft_s), before))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--method", default="graft")
    ap.add_argument("--budget", type=int, default=7)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--passes", type=int, default=4)
    args = ap.parse_args()
    engine = Engine(args.model, args.dtype)
    engine.budget_policy = lambda req, batch: 0  # every step: K = 0, as under load
    prompts = [item.turns[0] for item in load_gsm8k()[::40][: args.requests]]
    methods = ("ar", args.method)
    admit, step = {m: [] for m in methods}, {m: [] for m in methods}
    for m in methods:  # warm-up
        wave(engine, prompts[:2], m, args.budget, 4)
    for i in range(args.passes):
        for m in (methods if i % 2 else methods[::-1]):
            a, s = wave(engine, prompts, m, args.budget, args.tokens)
            admit[m] += a
            step[m].append(s)
    for m in methods:
        total, verify, draft = (1000 * statistics.median(s[j] for s in step[m]) for j in range(3))
        print(f"{m}: admission {1000 * statistics.median(admit[m]):.1f} ms (median of {len(admit[m])}); "
              f"step {total:.2f} ms, verify {verify:.2f}, drafting {draft:.2f} (medians of {args.passes} passes)")


if __name__ == "__main__":
    main()
