"""The adjacency matrix's update top-k: ``torch.topk`` over the whole vocabulary against ``top_indices``
(``drafters/matrix.py``; what the update calls: the blocked top-k where that saves time), on ``[W, V]`` logits
of the shapes the update sees: W verified nodes a step (B requests x their tree), or a prompt's rows at prefill.

    python scripts/matrix_topk_cost.py --vocab 151936 49152 --rows 1 8 64 128 --dtype bfloat16 float32

Logits are standard normal (seeded): the blocked top-k does the same work on any values, ``torch.topk``'s
selection may not (scripts/draft_batch_cost.py --plain-topk times both on a real model's logits). Each repetition
runs both arms on every cell (``--calls`` calls each, timed together), the arms' order alternating; repetition 0
is the warm-up. Every call's values are checked equal between the arms. Prints a table (median ms per call;
blocked / plain as a ratio of mean times with a bootstrap 95% interval over repetitions) and writes the
per-repetition times as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from specgraft.drafters.matrix import full_topk, top_indices
from specgraft.env import environment
from specgraft.eval.report_stats import ratio_of_ratios


ARMS = {"plain": full_topk, "blocked": top_indices}


def timed(fn, logits: torch.Tensor, k: int, calls: int) -> tuple[float, torch.Tensor]:
    """Mean seconds of ``calls`` calls in a row (a one-row call is a few hundred microseconds) and the result."""
    start = time.perf_counter()
    for _ in range(calls):
        got = fn(logits, k)
    return (time.perf_counter() - start) / calls, got


def run_cells(cells: list[tuple[int, str, int]], k: int, reps: int, calls: int) -> dict[str, dict[str, list[float]]]:
    gen = torch.Generator().manual_seed(0)
    data = {c: torch.randn(c[2], c[0], generator=gen).to(getattr(torch, c[1])) for c in cells}
    times = {f"V={v} {dt} W={w}": {arm: [] for arm in ARMS} for v, dt, w in cells}
    for rep in range(reps + 1):
        order = list(ARMS) if rep % 2 == 0 else list(reversed(ARMS))
        for cell in cells:
            logits = data[cell]
            got = {}
            for arm in order:
                seconds, got[arm] = timed(ARMS[arm], logits, k, calls)
                if rep:  # repetition 0 warms up
                    times[f"V={cell[0]} {cell[1]} W={cell[2]}"][arm].append(seconds)
            if not torch.equal(logits.gather(1, got["plain"]), logits.gather(1, got["blocked"])):
                raise SystemExit(f"error: the arms' top-{k} values differ on cell {cell}")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[151936, 49152])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 128])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=5, help="calls timed together in one repetition")
    ap.add_argument("--out", default="runs/matrix-topk.json")
    args = ap.parse_args()
    cells = [(v, dt, w) for v in args.vocab for dt in args.dtype for w in args.rows]
    times = run_cells(cells, args.k, args.reps, args.calls)
    summary = {}
    print("| cell | plain ms | blocked ms | blocked / plain |")
    print("|---|---|---|---|")
    for name, arms in times.items():
        est = ratio_of_ratios(np.array(arms["blocked"]), np.ones(args.reps), np.array(arms["plain"]),
                              np.ones(args.reps))
        summary[name] = {arm: round(1000 * statistics.median(t), 3) for arm, t in arms.items()}
        summary[name]["ratio"] = [round(est.point, 3), round(est.lo, 3), round(est.hi, 3)]
        print(f"| {name} | {summary[name]['plain']} | {summary[name]['blocked']} | {est.fmt()} |")
    env = environment()  # the machine, and the commit with its dirty flag
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "commit": env.get("commit"), "dirty": env.get("dirty"),
                                          "threads": torch.get_num_threads(), "environment": env,
                                          "summary": summary, "times": times}, indent=1))


if __name__ == "__main__":
    main()
