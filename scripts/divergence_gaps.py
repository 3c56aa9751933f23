"""Are a run's greedy divergences near-ties? (docs/benchmarks.md, "Issue 25")

    python scripts/divergence_gaps.py docs/data/cpu-step-amd-qwen15.jsonl --ref int4-ar --label int4-pld int4-graft

For each prompt where a label's greedy output leaves its AR reference's, the reference backend (the records'
backend and weights) recomputes the target's logits one token at a time up to the first differing position and
prints the gap between the top logit and the two tokens: a near-tie when both are within the backend's declared
``tie_gap``. One JSON line per divergence, then a summary.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from specgraft import Engine
from specgraft.core.tree import Tree
from specgraft.eval.datasets import load_dataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("records")
    p.add_argument("--ref", required=True)
    p.add_argument("--label", nargs="+", required=True)
    args = p.parse_args()
    recs = [json.loads(line) for line in open(args.records)]
    key = lambda r: (r["dataset"], r["prompt_id"], r["turn"], r["seed"])  # noqa: E731
    by = defaultdict(dict)
    for r in recs:
        by[r["label"]][key(r)] = r
    ref0 = next(iter(by[args.ref].values()))
    engine = Engine(ref0["model"], ref0["dtype"] if ref0["backend"] == "transformers" else "bfloat16",
                    backend=ref0["backend"])
    gap_limit = engine.capabilities.tie_gap
    gaps = []
    for label in args.label:
        for k, r in by[label].items():
            ar = by[args.ref][k]
            if r["output_ids"] == ar["output_ids"]:
                continue
            i = next(j for j, (a, b) in enumerate(zip(ar["output_ids"], r["output_ids"])) if a != b)
            prompt = engine.encode(items(r["dataset"])[r["prompt_id"]].turns[0])
            assert len(prompt) == ar["prompt_tokens"], "the prompt did not re-encode to the recorded length"
            row = gap_at(engine, prompt, ar, r, i)
            row.update(label=label, prompt=k[1], position=i, tie=max(row["gap_ar"], row["gap_method"]) < gap_limit)
            gaps.append(row)
            print(json.dumps(row), flush=True)
    ties = sum(g["tie"] for g in gaps)
    print(json.dumps({"divergences": len(gaps), "near_ties": ties, "tie_gap": gap_limit,
                      "largest_gap": max((max(g["gap_ar"], g["gap_method"]) for g in gaps), default=0.0)}))


_ITEMS: dict = {}


def items(dataset: str) -> dict:
    """A dataset's items by id (first-turn records only: the prompt is the first turn)."""
    if dataset not in _ITEMS:
        _ITEMS[dataset] = {it.id: it for it in load_dataset(dataset)}
    return _ITEMS[dataset]


def gap_at(engine, prompt: list[int], ar: dict, other: dict, i: int) -> dict:
    """The reference backend's logits at the first differing position, fed the prompt and AR's tokens one step
    at a time as AR itself computed them."""
    be = engine.backend
    logits = be.prefill(torch.tensor(prompt)).logits[-1]
    for pos in range(i):
        logits = be.verify(Tree.chain(ar["output_ids"][pos], [])).logits[0]
        be.commit([0])
    be.reset()
    logits = logits.float()
    top = float(logits.max())
    return {"gap_ar": round(top - float(logits[ar["output_ids"][i]]), 4),
            "gap_method": round(top - float(logits[other["output_ids"][i]]), 4)}


if __name__ == "__main__":
    main()
