"""Single-request speed before and after the engine redesign, in one interleaved run.

Two worker processes, one per code version (``--before``: the ``src`` directory of a checkout of the old
commit; the new code is this repository's ``src``), each with the target loaded. The driver sends them one
request at a time (never two at once), for every prompt and method, the order of (version, method) rotated by
one place per prompt; warm-up on a prompt outside the evaluation set. ``after#2`` repeats every ``after`` request
on the same worker: the after#2 / after ratio is the run's noise. Prints a per-prompt table and the after /
before speed ratio per method with a bootstrap 95% interval over prompts; records to ``--out``.

    git worktree add /tmp/before 197fc81
    python scripts/engine_ab.py --before /tmp/before/src --out runs/engine-ab.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
METHODS = [("ar", {}), ("graft", {"budget": 7})]  # Graft at its main-table setting


def worker(model: str, dtype: str) -> None:
    import specgraft
    from specgraft import Engine

    engine = Engine(model, dtype)
    print(json.dumps({"ready": specgraft.__file__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        opts = dict(req["options"])
        g = engine.generate(req["prompt"], req["method"], max_new_tokens=req["max_new_tokens"], **opts)
        s = g.stats
        print(json.dumps({"tokens": s.new_tokens, "wall_s": s.total_s, "steps": s.steps, "mat": s.mat,
                          "token_ids": g.token_ids}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", help="src directory of the old checkout (required unless --worker)")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="runs/engine-ab.jsonl")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args.model, args.dtype)
    if not args.before:
        ap.error("--before is required")

    sys.path.insert(0, str(REPO / "src"))
    from specgraft.env import environment
    from specgraft.eval.datasets import load_dataset
    from specgraft.eval.harness import WARMUP_PROMPT
    from specgraft.eval.report_stats import ratio_of_ratios

    items = load_dataset("mtbench", 5, 10) + load_dataset("humaneval", 5, 20)
    prompts = [(it.id, it.turns[0]) for it in items]
    procs = {}
    for version, src in (("before", args.before), ("after", str(REPO / "src"))):
        env = {**os.environ, "PYTHONPATH": src}
        p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model, "--dtype", args.dtype],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/tmp")
        ready = json.loads(p.stdout.readline())
        assert Path(ready["ready"]).resolve().is_relative_to(Path(src).resolve()), (version, ready)
        procs[version] = p

    def ask(version, method, opts, prompt):
        p = procs[version.split("#")[0]]
        p.stdin.write(json.dumps({"prompt": prompt, "method": method, "options": opts,
                                  "max_new_tokens": args.max_new_tokens}) + "\n")
        p.stdin.flush()
        return json.loads(p.stdout.readline())

    cells = [(v, m, o) for v in ("before", "after", "after#2") for m, o in METHODS]
    for v, m, o in cells:  # warm-up outside the evaluation set
        if "#" not in v:
            ask(v, m, o, WARMUP_PROMPT)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = environment()
    rows = []
    with out.open("w") as f:
        for i, (pid, prompt) in enumerate(prompts):
            k = i % len(cells)
            for v, m, o in cells[k:] + cells[:k]:
                r = ask(v, m, o, prompt)
                rec = {"prompt_id": pid, "version": v, "method": m, "options": o, **r, "commit": env["commit"],
                       "dirty": env["dirty"], "model": args.model, "dtype": args.dtype}
                f.write(json.dumps(rec) + "\n")
                f.flush()
                rows.append(rec)
                print(f"{pid} {v} {m}: {r['tokens'] / r['wall_s']:.2f} tok/s, MAT {r['mat']:.2f}", file=sys.stderr)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    print(report(rows, ratio_of_ratios, env))


def report(rows: list[dict], ratio_of_ratios, env: dict) -> str:
    by = {(r["prompt_id"], r["version"], r["method"]): r for r in rows}
    pids = list(dict.fromkeys(r["prompt_id"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    versions = list(dict.fromkeys(r["version"] for r in rows))
    head = "| prompt | " + " | ".join(f"{m} {v}" for m in methods for v in versions) + " | outputs equal |"
    lines = [head, "|" + "---|" * (len(methods) * len(versions) + 2)]
    for pid in pids:
        cells = [f"{by[(pid, v, m)]['tokens'] / by[(pid, v, m)]['wall_s']:.2f}" for m in methods for v in versions]
        same = all(by[(pid, v, m)]["token_ids"] == by[(pid, "before", m)]["token_ids"] for m in methods for v in versions)
        lines.append(f"| {pid} | " + " | ".join(cells) + f" | {same} |")
    lines.append("")

    def ratio(m, num, den):
        a, b = [by[(p, num, m)] for p in pids], [by[(p, den, m)] for p in pids]
        return ratio_of_ratios([x["wall_s"] for x in b], [x["tokens"] for x in b],
                               [x["wall_s"] for x in a], [x["tokens"] for x in a])

    for m in methods:
        speed = {v: sum(by[(p, v, m)]["tokens"] for p in pids) / sum(by[(p, v, m)]["wall_s"] for p in pids)
                 for v in versions}
        est = ratio(m, "after", "before")
        line = (f"- {m}: before {speed['before']:.2f} tok/s, after {speed['after']:.2f} tok/s; after / before "
                f"{est.point:.3f}x [{est.lo:.3f}, {est.hi:.3f}] over {est.n} prompts")
        if "after#2" in versions:
            noise = ratio(m, "after#2", "after")
            line += f"; noise (after#2 / after) {noise.point:.3f}x [{noise.lo:.3f}, {noise.hi:.3f}]"
        lines.append(line)
    lines.append(f"- commit {env['commit']} (dirty: {env['dirty']})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
