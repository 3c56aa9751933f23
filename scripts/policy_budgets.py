"""The scheduler's budget K*(B) for a calibrated method at each batch size, from this machine's cached cost curve
(measured first if absent) and the method's shipped calibration: what `specgraft serve` would give each greedy
request in a step of B requests (serve/policy.py).

    python scripts/policy_budgets.py --model qwen2.5-coder-1.5b --dtype bfloat16 --method graft --budget 7
"""

from __future__ import annotations

import argparse

from specgraft import Engine
from specgraft.serve.policy import BatchBudget


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backend", default="transformers")
    ap.add_argument("--method", default="graft")
    ap.add_argument("--budget", type=int, default=7)
    ap.add_argument("--max-batch", type=int, default=16)
    args = ap.parse_args()
    engine = Engine(args.model, args.dtype, backend=args.backend)
    policy = BatchBudget(engine)
    config = {"method": args.method}
    widths = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    print(f"{args.model} {engine.dtype} ({args.backend}): curve ms at " +
          ", ".join(f"{w}: {1000 * policy.curve[w]:.1f}" for w in widths if w in policy.curve))
    print(f"{args.method} budget {args.budget}: K at B = 2..{args.max_batch}: " +
          " ".join(str(policy.budget_for(config, args.budget, b)) for b in range(2, args.max_batch + 1)) +
          f" (knee {policy.knee})")


if __name__ == "__main__":
    main()
