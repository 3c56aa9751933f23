"""How much the draft-tree position fix changed acceptance (issue 12, bug 1); NOT run in CI.

    python scripts/draft_tree_position_ab.py [--limit 2] [--max-new-tokens 96]

One process, one loaded target and draft model. The same draft-tree drafter (top-k 4, depth 4, 16 nodes) runs
each prompt twice, interleaved and alternating which goes first: as fixed (a node at depth d sits at
``prefix_len + d - 1``) and with the old off-by-one restored by shifting every tree position of the draft's
level-by-level forwards by +1 (exactly what the drafter did before the fix). Prompts: the dev split of
configs/graft-dev-sweep.toml (never the main table's). Prints MAT and tokens/s per prompt and overall.
"""

from __future__ import annotations

import argparse
import time

from specgraft import Engine
from specgraft.eval.datasets import load_dataset
from specgraft.eval.harness import WARMUP_PROMPT

SPLITS = (("mtbench", 10, 5), ("humaneval", 20, 10), ("gsm8k", 50, 25))  # name, stride, offset (dev split)
OPTS = {"shape": "tree", "top_k": 4, "depth": 4, "budget": 16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    engine = Engine(args.model, "bfloat16")
    drafter = engine.drafter("draft", **OPTS)
    extend = drafter.backend.extend
    state = {"shift": 0}
    drafter.backend.extend = lambda toks, pos, vis: extend(toks, pos + state["shift"], vis)

    def run(prompt: str, shift: int) -> tuple[float, int, float]:
        state["shift"] = shift
        g = engine.generate(prompt, "draft", max_new_tokens=args.max_new_tokens, **OPTS)
        return g.stats.mat, g.stats.new_tokens, g.stats.total_s

    run(WARMUP_PROMPT, 0)  # warm-up, outside every dataset
    totals = {0: [0.0, 0, 0.0, 0], 1: [0.0, 0, 0.0, 0]}
    print("| prompt | MAT fixed | MAT old (+1) | tok/s fixed | tok/s old |\n|---|---|---|---|---|")
    k = 0
    for name, stride, offset in SPLITS:
        for item in load_dataset(name, args.limit, stride, offset=offset, max_turns=1):
            res = {}
            for shift in ((0, 1) if k % 2 == 0 else (1, 0)):
                res[shift] = run(item.turns[0], shift)
                mat, n, t = res[shift]
                tot = totals[shift]
                tot[0] += mat * 1
                tot[1] += n
                tot[2] += t
                tot[3] += 1
            k += 1
            print(f"| {name}/{item.id} | {res[0][0]:.2f} | {res[1][0]:.2f} | {res[0][1] / res[0][2]:.2f} | "
                  f"{res[1][1] / res[1][2]:.2f} |", flush=True)
    for shift, label in ((0, "fixed"), (1, "old (+1)")):
        mat, n, t, c = totals[shift]
        print(f"overall {label}: mean MAT {mat / c:.3f}, {n / t:.2f} tok/s ({time.strftime('%Y-%m-%d')})")


if __name__ == "__main__":
    main()
