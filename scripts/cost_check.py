"""Does the cached cost curve predict a run's verification time? (docs/benchmarks.md, "CPU step")

    python scripts/cost_check.py runs/cpu-step-qwen15.jsonl --curve int4-ar=PATH --curve int4-pld=PATH ...

``PATH`` is a curve cached by ``costs.latency_curve`` (``$SPECGRAFT_CACHE/latency/KEY.json``) or a
``backend_costs.py verify`` JSON line. Per record: predicted = steps x curve(1 + tree nodes per step), the
measured value is the record's ``verify_s``; printed per label: the median ratio and its range over prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics

from specgraft.costs import interpolate


def read_curve(path: str) -> dict[int, float]:
    with open(path) as f:
        raw = json.load(f)
    if "seconds" in raw:
        return {int(k): float(v) for k, v in raw["seconds"].items()}
    return {int(k): float(v) / 1000 for k, v in raw["ms"].items()}  # backend_costs.py verify


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("records")
    p.add_argument("--curve", action="append", default=[], help="LABEL=PATH")
    args = p.parse_args()
    curves = {label: read_curve(path) for label, path in (c.split("=", 1) for c in args.curve)}
    ratios: dict[str, list[float]] = {label: [] for label in curves}
    for line in open(args.records):
        rec = json.loads(line)
        curve = curves.get(rec["label"])
        if curve is None or not rec["steps"]:
            continue
        width = 1 + rec["tree_nodes"] / rec["steps"]
        ratios[rec["label"]].append(rec["verify_s"] / (rec["steps"] * interpolate(curve, width)))
    out = {}
    for label, rs in ratios.items():
        if rs:
            out[label] = {"prompts": len(rs), "median": round(statistics.median(rs), 3),
                          "min": round(min(rs), 3), "max": round(max(rs), 3)}
            print(f"{label:14s} measured / predicted: median {out[label]['median']:.3f} "
                  f"[{out[label]['min']:.3f}, {out[label]['max']:.3f}] over {len(rs)} prompts")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
