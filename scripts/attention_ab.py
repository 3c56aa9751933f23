"""The transformers step with transformers' own attention and cache against ours (``core/attention.py``), on the
same weights in one process, interleaved (docs/benchmarks.md, "Grouped-query attention without copies"):

    transformers        SDPA with ``repeat_kv`` (every key/value head copied per query head when a forward has
                        several tokens), ``DynamicLayer`` (the cache concatenated every step)
    grouped             query heads folded onto their key/value head, ``DynamicLayer``
    grouped+positional  the same, and the cache written by position (``PositionalLayer``)

    python scripts/attention_ab.py --model qwen2.5-coder-1.5b --dtype bfloat16 --rows 1 4 16 --widths 1 2 4 8

A cell is one step (``verify_batch`` over ``rows`` trees of ``width`` tokens each, then ``commit_batch`` of the
root) after each row prefilled a fixed ``--prefix``-token text (no evaluation prompt). Every repetition runs
every cell on every arm with the arms' order rotated; repetition 0 is the warm-up; medians. Each arm keeps its own
rows, which grow by one token per step, equally. Prints one JSON line and a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from transformers import DynamicCache

TEXT = ("The quick brown fox jumps over the lazy dog while the river runs past the old mill and the miller counts "
        "his sacks of flour one by one before the market opens in the square. ") * 200


def arms(model):
    from specgraft.core.attention import NAME, positional_cache
    from specgraft.core.backend import TargetBackend

    def plain_cache(config):
        return DynamicCache(config=config)

    spec = {"transformers": ("sdpa", plain_cache), "grouped": (NAME, plain_cache),
            "grouped+positional": (NAME, positional_cache)}
    out = {}
    for name, (attention, cache) in spec.items():
        be = TargetBackend(model)
        be.new_cache = cache
        out[name] = (be, attention)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()

    from specgraft.backends import load_transformers
    from specgraft.core.tree import Tree

    model, tok, _ = load_transformers(args.model, args.dtype, None, "cpu")
    ids = tok(TEXT).input_ids[: args.prefix]
    times: dict[str, dict[tuple[int, int], list[float]]] = {}
    for rows in args.rows:
        backends = arms(model)
        for name, (be, attention) in backends.items():
            model.set_attn_implementation(attention)
            for _ in range(rows):
                be.add(torch.tensor(ids))
        names = list(backends)
        for rep in range(args.reps + 1):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for w in args.widths:
                trees = [Tree.chain(ids[-1], ids[1:w])] * rows
                for name in order:
                    be, attention = backends[name]
                    model.set_attn_implementation(attention)
                    start = time.perf_counter()
                    be.verify_batch(trees)
                    be.commit_batch([[0]] * rows)
                    if rep:
                        times.setdefault(name, {}).setdefault((rows, w), []).append(time.perf_counter() - start)
        print(f"rows {rows}: " + "; ".join(
            f"{name} " + " ".join(f"w{w}:{statistics.median(times[name][(rows, w)]) * 1000:.1f}"
                                  for w in args.widths) for name in names), file=sys.stderr, flush=True)
    ms = {name: {f"{r}x{w}": round(statistics.median(v) * 1000, 1) for (r, w), v in cells.items()}
          for name, cells in times.items()}
    print(json.dumps({"what": "attention_ab_ms", "model": args.model, "dtype": args.dtype, "prefix": args.prefix,
                      "reps": args.reps, "threads": torch.get_num_threads(), "ms": ms}))


if __name__ == "__main__":
    main()
