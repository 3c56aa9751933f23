"""Aggregate throughput at batch sizes B (`specgraft batch`): the engine with up to B requests in flight.

Continuous batching, as a server runs it: B requests join, and whenever one finishes the next prompt joins
at the following step. Methods are interleaved per batch size after a warm-up on a prompt outside the
evaluation set, the method order rotated by one place per batch size; resumable (one JSONL record per finished (batch size, method) pair). Greedy outputs are
compared with the B = 1 outputs (they must be equal: docs/design.md §2).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..core.stats import Stats
from ..engine import Engine
from ..env import environment
from ..errors import SpecgraftError
from .harness import WARMUP_PROMPT, MethodSpec, rotated


def run_batch(engine: Engine, method: str, options: dict, prompts: list[list[int]], batch_size: int,
              max_new_tokens: int) -> tuple[list[list[int]], Stats, float]:
    """Decode ``prompts`` with at most ``batch_size`` in flight; (outputs in prompt order, merged request
    stats, wall seconds). The engine must be idle."""
    if engine.active:
        raise SpecgraftError("run_batch needs an idle engine")
    t0, before = time.perf_counter(), engine.totals.to_dict()
    queue, order, results = list(enumerate(prompts)), {}, {}
    while queue or engine.has_unfinished():
        while queue and len(engine.active) < batch_size:
            i, ids = queue.pop(0)
            order[engine.add_request(ids, method, max_new_tokens=max_new_tokens, **options)] = i
        for out in engine.step():
            if out.finished:
                results[order[out.request_id]] = out.result
    wall = time.perf_counter() - t0
    merged = Stats(method)
    for i in range(len(prompts)):
        merged = merged.merge(results[i].stats)
    # Engine-wide counters over this run: steps are batched forwards (not request-steps); total_s is the time
    # inside steps (prefills excluded), verify_s the target forwards, draft_forward_s the drafters' forwards.
    for name in ("steps", "verify_s", "draft_s", "draft_forward_s", "total_s"):
        setattr(merged, name, getattr(engine.totals, name) - before[name])
    return [results[i].token_ids for i in range(len(prompts))], merged, wall


def host_share(stats: Stats) -> float:
    """The share of step time spent outside the target and drafter forwards (drafting logic, masks, rules,
    commits, detokenisation): what a faster host loop could still win."""
    host = stats.total_s - stats.verify_s - stats.draft_forward_s
    return host / stats.total_s if stats.total_s else float("nan")


def run_batch_bench(engine: Engine, specs: list[MethodSpec], prompts: list[list[int]], batch_sizes: list[int],
                    max_new_tokens: int, out_path, progress=None) -> list[dict]:
    """Throughput per (batch size, method); see the module docstring."""
    out_path = Path(out_path)
    done = {}
    if out_path.exists():
        for line in out_path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[(r["label"], r["batch_size"])] = r
    lossy = [s.label for s in specs if s.verify != "lossless" or s.sampling]
    if lossy:
        raise SpecgraftError(f"batch mode is greedy and lossless; remove verify/min_p/eta from: {', '.join(lossy)}")
    warm = engine.encode(WARMUP_PROMPT)
    for spec in specs:  # warm-up: a short batch of two per method
        run_batch(engine, spec.method, spec.options, [warm, warm], 2, 8)
    env = environment()
    total, n = len(specs) * len(batch_sizes), 0
    for b, bsz in enumerate(batch_sizes):
        for spec in rotated(specs, b):  # the method order rotates by one place per batch size
            n += 1
            if (spec.label, bsz) in done:
                continue
            outs, stats, wall = run_batch(engine, spec.method, spec.options, prompts, bsz, max_new_tokens)
            tokens = sum(len(o) for o in outs)
            single = done.get((spec.label, 1))
            rec = {"label": spec.label, "method": spec.method, "options": spec.options, "batch_size": bsz,
                   "prompts": len(prompts), "max_new_tokens": max_new_tokens, "tokens": tokens,
                   "wall_s": wall, "throughput": tokens / wall if wall else 0.0, "mat": stats.mat,
                   "steps": stats.steps, "draft_s": stats.draft_s, "verify_s": stats.verify_s,
                   "draft_forward_s": stats.draft_forward_s, "step_s": stats.total_s,
                   "host_share": host_share(stats),
                   "outputs": outs, "equal_to_batch1": None if single is None else single["outputs"] == outs,
                   "model": engine.model_name, "dtype": engine.dtype,
                   "backend": engine.backend_name, "device": engine.device, "env": env}
            done[(spec.label, bsz)] = rec
            with open(out_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if progress:
                progress(n, total, f"B={bsz} {spec.label}: {rec['throughput']:.2f} tok/s")
    return [done[(s.label, b)] for b in batch_sizes for s in specs]
