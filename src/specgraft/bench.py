"""Minimal side-by-side benchmark: several methods on the same prompts, interleaved, AR as the baseline.

Protocol (what makes the ratios trustworthy): one process and one loaded model; a warm-up generation per
method first (not recorded); then for each prompt every method runs back to back, in an order rotated per
prompt so that no method always runs first; greedy outputs are checked token-for-token against AR.
Speedup = AR wall time / method wall time over all prompts (greedy), or the per-token ratio (sampling).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .decode import Engine
from .errors import SpecgraftError
from .sampling import SamplingParams
from .stats import Stats


@dataclass(frozen=True)
class MethodSpec:
    label: str  # as given, e.g. "recycle:budget=32"
    method: str
    options: dict


def parse_method(spec: str) -> MethodSpec:
    """``name`` or ``name:key=value,key=value`` (values parsed as int/float when they look like one)."""
    name, _, rest = spec.strip().partition(":")
    opts: dict = {}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        if not eq:
            raise SpecgraftError(f"bad method option '{item}' in '{spec}' (expected key=value)")
        for cast in (int, float):
            try:
                val = cast(val)
                break
            except ValueError:
                pass
        opts[key.strip()] = val
    return MethodSpec(spec.strip(), name, opts)


def machine_info() -> dict:
    import torch
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "commit": commit}


def run_bench(engine: Engine, prompts: list[tuple[str, str, str]], methods: list[MethodSpec],
              sampling: SamplingParams, max_new_tokens: int, warmup: int = 1, out_path: str | None = None,
              progress=None) -> dict:
    """Run every method on every prompt; return totals per method label plus the exactness check."""
    if not any(m.method == "ar" for m in methods):
        methods = [MethodSpec("ar", "ar", {}), *methods]
    for m in methods:  # fail on a bad method before any model time is spent
        engine.drafter(m.method, **m.options)
    for m in methods:
        for _ in range(warmup):
            engine.generate(prompts[0][2], m.method, sampling=sampling, max_new_tokens=min(32, max_new_tokens),
                            **m.options)
    totals = {m.label: Stats(m.method) for m in methods}
    mismatches: dict[str, list[str]] = {m.label: [] for m in methods}
    out = open(out_path, "a", encoding="utf-8") if out_path else None
    info = machine_info()
    try:
        for i, (pid, category, text) in enumerate(prompts):
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            ar_ids = None
            results = {}
            for m in order:
                g = engine.generate(text, m.method, sampling=sampling, max_new_tokens=max_new_tokens, **m.options)
                results[m.label] = g
                totals[m.label] = totals[m.label].merge(g.stats)
                if progress:
                    progress(m.label, pid)
            ar_ids = next(results[m.label].token_ids for m in methods if m.method == "ar")
            for label, g in results.items():
                if sampling.greedy and g.token_ids != ar_ids:
                    mismatches[label].append(pid)
                if out:
                    rec = {"prompt_id": pid, "category": category, "label": label, **g.to_record(),
                           "machine": info}
                    out.write(json.dumps(rec) + "\n")
            if out:
                out.flush()
    finally:
        if out:
            out.close()
    return {"totals": totals, "mismatches": mismatches, "machine": info, "greedy": sampling.greedy}


def speedup(base: Stats, other: Stats, greedy: bool) -> float:
    if greedy:
        return base.total_s / other.total_s if other.total_s else 0.0
    per_tok = lambda s: s.total_s / s.new_tokens if s.new_tokens else float("inf")  # noqa: E731
    return per_tok(base) / per_tok(other)


def format_table(result: dict) -> str:
    totals, greedy = result["totals"], result["greedy"]
    base = next(s for s in totals.values() if s.method == "ar")
    rows = ["| method | tokens | time (s) | tok/s | MAT | speedup vs AR | mean tree nodes | draft / verify / other (s) "
            "| greedy == AR |", "|---|---|---|---|---|---|---|---|---|"]
    for label, s in totals.items():
        d = s.to_dict()
        same = "n/a (sampling)" if not greedy else (
            "yes" if not result["mismatches"][label] else f"NO ({len(result['mismatches'][label])})")
        rows.append(f"| {label} | {s.new_tokens} | {s.total_s:.2f} | {s.tokens_per_s:.2f} | {s.mat:.2f} | "
                    f"{speedup(base, s, greedy):.2f}x | {d['mean_tree_nodes']:.1f} | "
                    f"{s.draft_s:.2f} / {s.verify_s:.2f} / {s.other_s:.2f} | {same} |")
    return "\n".join(rows)
