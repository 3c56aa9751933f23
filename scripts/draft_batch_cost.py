"""Drafting time per engine step with B requests in flight: batched across requests vs each request alone.

Issue 27's goal: the draft time per step at B = 8 at most 2x the B = 1 draft time. For each method, batch
size and mode (``batched``: the engine's lockstep driver, one head forward per round for the whole batch;
``alone``: each request drafted on its own, one after another, as before issue 27), B requests decode GSM8K
prompts at a fixed budget (no budget policy); only steps with all B in flight count. Cells run interleaved,
the order rotated each repeat, after a warm-up on a prompt outside the set. Prints the per-step medians and
writes every step's timings as JSON.

    python scripts/draft_batch_cost.py --model qwen2.5-coder-1.5b --dtype bfloat16 --methods eagle,graft \
        --batch-sizes 1,8 --budget 7 --repeats 3 --out runs/draft-batch-qwen15.json
    python scripts/draft_batch_cost.py --backend llamacpp --dtype gguf --methods draft \
        --opts '{"shape": "tree", "top_k": 3, "depth": 4}' --batch-sizes 1,4,8 --budget 8 --out runs/draft-tree.json
    python scripts/draft_batch_cost.py --backend llamacpp --dtype gguf --opts '{"shape": "tree", "depth": 4}' \
        --methods "draft:top_k=3;draft:top_k=4" --batch-sizes 1,8 --budget 8 --out runs/draft-tree-k.json

``--methods`` entries are ';'-separated, each ``METHOD[:key=value,...]`` (options over ``--opts``); an entry
without options may list several methods with ',' (``eagle,graft``). ``--full-frontier`` adds, for each EAGLE
cell, one whose trees expand every level to ``top_k`` (``EagleDrafter.cap_frontier = False``: before the cap
at what the rerank can keep), interleaved with the rest. ``--plain-head`` adds, for each EAGLE cell, one whose
head keeps PyTorch's plain linear layers (loaded with ``SPECGRAFT_PREPACK=0``; the default head's layers are
prepacked for oneDNN, ``backends/packed.py``). ``--per-unit-attention`` adds, for each batched EAGLE or Graft
cell with B > 1, one whose head attends every request's unit in its own call (``HeadRunner.pad_attention =
False``: before similar units shared one padded call). ``--plain-topk`` adds, for each batched Graft or Token
Recycling cell, one whose adjacency-matrix updates take ``torch.topk`` over the whole vocabulary
(``AdjacencyMatrix.blocked_topk = False``: before the blocked top-k).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from specgraft.drafters.matrix import AdjacencyMatrix
from specgraft.eagle.batch import HeadRunner
from specgraft.eagle.drafter import EagleDrafter
from specgraft.engine import Engine
from specgraft.env import environment
from specgraft.eval.datasets import load_gsm8k
from specgraft.eval.harness import WARMUP_PROMPT, parse_method


class PassCounter:
    """Counts head forwards (``HeadRunner.run`` calls) and the request units in them."""

    def __init__(self):
        self.passes = self.units = 0
        real = HeadRunner.run

        def counted(runner, units):
            self.passes, self.units = self.passes + 1, self.units + len(units)
            return real(runner, units)

        HeadRunner.run = counted


PASSES = PassCounter()


def one_cell(engine: Engine, method: str, prompts: list[str], batch: int, batched: bool, budget: int,
             max_new_tokens: int, opts: dict, full_frontier: bool = False, per_unit: bool = False,
             plain_topk: bool = False) -> list[dict]:
    """Every step with all ``batch`` requests in flight: its drafting seconds (propose + observe), head
    seconds, head forwards and the request units in them."""
    engine.batch_drafts = batched
    EagleDrafter.cap_frontier = not full_frontier
    HeadRunner.pad_attention = not per_unit
    AdjacencyMatrix.blocked_topk = not plain_topk
    try:
        return cell_steps(engine, method, prompts, batch, budget, max_new_tokens, opts)
    finally:
        engine.batch_drafts, EagleDrafter.cap_frontier, HeadRunner.pad_attention = True, True, True
        AdjacencyMatrix.blocked_topk = True


# A plain-head cell asks for its drafter with this option (the default's value) on top of its own: another
# prototype, whose head is loaded with packing switched off (plain_head_prototype)
PLAIN_HEAD = {"top_k": 10}


def plain_head_prototype(engine: Engine, opts: dict) -> None:
    """Builds the EAGLE prototype a plain-head cell with options ``opts`` uses, its head loaded without
    prepacked layers."""
    if "top_k" in opts:
        print("error: --plain-head marks its cells with top_k=10; run it without a top_k option", file=sys.stderr)
        raise SystemExit(2)
    before = os.environ.get("SPECGRAFT_PREPACK")
    os.environ["SPECGRAFT_PREPACK"] = "0"
    try:
        engine.drafter("eagle", **opts, **PLAIN_HEAD)
    finally:
        if before is None:
            os.environ.pop("SPECGRAFT_PREPACK")
        else:
            os.environ["SPECGRAFT_PREPACK"] = before


def cell_steps(engine: Engine, method: str, prompts: list[str], batch: int, budget: int, max_new_tokens: int,
               opts: dict) -> list[dict]:
    for p in prompts[:batch]:
        engine.add_request(p, method, max_new_tokens=max_new_tokens, budget=budget, **opts)
    steps = []
    while engine.has_unfinished():
        full = len(engine.active) == batch
        before = engine.totals.draft_s, engine.totals.draft_forward_s, PASSES.passes, PASSES.units
        engine.step()
        if full:
            steps.append({"draft_s": engine.totals.draft_s - before[0],
                          "head_s": engine.totals.draft_forward_s - before[1],
                          "head_passes": PASSES.passes - before[2], "head_units": PASSES.units - before[3]})
    return steps


def method_specs(methods: str, base: dict) -> dict[str, tuple[str, dict]]:
    """``"draft:top_k=3;draft:top_k=4"`` or ``"eagle,graft"`` -> {entry: (method, its options over ``base``)}."""
    entries = [e for part in methods.split(";") for e in (part.split(",") if ":" not in part else [part])]
    specs = {}
    for entry in filter(None, (e.strip() for e in entries)):
        opts = parse_method(entry)
        specs[entry] = (opts.pop("name"), {**base, **opts})
    return specs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="transformers")
    ap.add_argument("--methods", default="eagle,graft")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--budget", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--opts", default="{}", help="the methods' options as JSON, e.g. a draft tree's shape")
    ap.add_argument("--alone", action=argparse.BooleanOptionalAction, default=True,
                    help="also run each B > 1 cell with every request drafted alone (--no-alone: batched only)")
    ap.add_argument("--full-frontier", action="store_true",
                    help="also run every eagle cell expanding each level to top_k (no cap; see the docstring)")
    ap.add_argument("--plain-head", action="store_true",
                    help="also run every eagle cell with the head's plain (not prepacked) layers")
    ap.add_argument("--per-unit-attention", action="store_true",
                    help="add, for each batched cell with B > 1, one whose units attend one call each")
    ap.add_argument("--plain-topk", action="store_true",
                    help="add, for each batched graft or recycle cell, one whose matrix updates take torch.topk")
    ap.add_argument("--out", default="runs/draft-batch.json")
    args = ap.parse_args()
    engine = Engine(args.model, args.dtype, backend=args.backend)
    specs = method_specs(args.methods, json.loads(args.opts))
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    questions = [item.turns[0] for item in load_gsm8k()[::40]]
    cells = [(m, b, mode) for m in specs for b in sizes
             for mode in (("batched", "alone") if b > 1 and args.alone else ("batched",))]
    if args.full_frontier:
        cells += [(m, b, f"{mode} full-frontier") for m, b, mode in cells if specs[m][0] == "eagle"]
    if args.plain_head:
        cells += [(m, b, f"{mode} plain-head") for m, b, mode in cells
                  if specs[m][0] == "eagle" and not mode.endswith("full-frontier")]
        for method, opts in specs.values():
            if method == "eagle":
                plain_head_prototype(engine, opts)
    if args.per_unit_attention:
        cells += [(m, b, "batched per-unit-attention") for m, b, mode in cells
                  if b > 1 and mode == "batched" and specs[m][0] in ("eagle", "graft")]
    if args.plain_topk:
        cells += [(m, b, "batched plain-topk") for m, b, mode in cells
                  if mode == "batched" and specs[m][0] in ("graft", "recycle")]
    warm = list(specs.values()) + ([("eagle", {**opts, **PLAIN_HEAD}) for method, opts in specs.values()
                                     if method == "eagle"] if args.plain_head else [])
    for method, opts in warm:  # warm-up outside the set
        for p in (WARMUP_PROMPT,) * 2:
            engine.add_request(p, method, max_new_tokens=16, budget=args.budget, **opts)
        engine.run()
    steps: dict[str, list[dict]] = {f"{m} B={b} {mode}": [] for m, b, mode in cells}
    for rep in range(args.repeats):
        order = cells[rep % len(cells):] + cells[: rep % len(cells)]
        for m, b, mode in order:
            start = (rep * max(sizes)) % len(questions)
            prompts = (questions[start:] + questions[:start])[:b]
            method, opts = specs[m]
            opts = {**opts, **PLAIN_HEAD} if mode.endswith("plain-head") else opts
            got = one_cell(engine, method, prompts, b, mode.startswith("batched"), args.budget, args.max_new_tokens,
                           opts, full_frontier=mode.endswith("full-frontier"),
                           per_unit=mode.endswith("per-unit-attention"), plain_topk=mode.endswith("plain-topk"))
            steps[f"{m} B={b} {mode}"].extend(got)
            print(f"repeat {rep} {m} B={b} {mode}: {len(got)} steps, median draft "
                  f"{1000 * statistics.median(s['draft_s'] for s in got):.1f} ms", flush=True)
    summary = {k: {"steps": len(v), "draft_ms_median": round(1000 * statistics.median(s["draft_s"] for s in v), 2),
                   "head_ms_median": round(1000 * statistics.median(s["head_s"] for s in v), 2),
                   "head_passes_mean": round(statistics.mean(s["head_passes"] for s in v), 2)}
               for k, v in steps.items()}
    print("| cell | steps | draft ms/step (median) | of which head ms | head forwards/step (mean) |")
    print("|---|---|---|---|---|")
    for k, v in summary.items():
        print(f"| {k} | {v['steps']} | {v['draft_ms_median']} | {v['head_ms_median']} | {v['head_passes_mean']} |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "commit": commit, "dirty": dirty,
                                          "environment": environment(), "summary": summary, "steps": steps},
                                         indent=1))


if __name__ == "__main__":
    main()
