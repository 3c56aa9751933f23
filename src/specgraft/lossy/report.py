"""Quality–efficiency table for LOSSY rules, each next to its correct baseline (``specgraft report --lossy``).

Every lossy label is paired with the label of the same method whose verification is lossless and whose
sampling is the rule's correct baseline (lossy/rules.py ``Rule.baseline``): min-p / eta truncation sampling at the
same parameter for SpecCascade / typical acceptance, plain sampling otherwise. Quality pools every record
(all seeds, all files); speed ratios come only from records of the same run (same file and seed), where the
methods were interleaved, and that include AR (follow-up runs of extra seeds add quality and MAT only).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from ..core.stats import mean_accepted_tokens
from ..core.sampling import TRUNCATION_KEYS
from .rules import parse_rule


_LOOP = ("verify", *TRUNCATION_KEYS)


def _options(label: str) -> tuple:
    """The drafter options of a label (``name:key=value,...``) without the loop keys (verify, min_p, eta)."""
    _, _, rest = label.partition(":")
    return tuple(sorted(x for x in rest.split(",") if x and x.split("=", 1)[0] not in _LOOP and "=" in x))


def _context(r: dict) -> tuple:
    """What must match between a configuration and its baseline: model, method, drafter options, sampling."""
    s = r.get("sampling", {})
    return (r.get("model"), r["method"], _options(r["label"]),
            (s.get("temperature"), s.get("top_k"), s.get("top_p")))


def _truncation(r: dict) -> tuple:
    s = r.get("sampling", {})
    return (round(float(s.get("min_p", 0.0)), 6), round(float(s.get("eta", 0.0)), 6))


def config_of(r: dict) -> tuple:
    return _context(r), r.get("verify", "lossless"), _truncation(r)


def baseline_of(r: dict) -> tuple:
    """The configuration of record ``r``'s correct baseline: the same context, lossless verification, and the
    run's own truncation sampling plus the rule's (min-p / eta at the rule's parameter)."""
    min_p, eta = _truncation(r)
    kind, v = parse_rule(r.get("verify", "lossless")).baseline()
    if kind == "min_p":
        min_p = round(v, 6)
    elif kind == "eta":
        eta = round(v, 6)
    return _context(r), "lossless", (min_p, eta)


class _Group:
    def __init__(self) -> None:
        self.q: dict[str, list[float]] = defaultdict(list)
        self.tokens = self.steps = self.committed = 0
        self.wall = 0.0
        self.seeds: set = set()

    def add(self, r: dict) -> None:
        if r.get("quality"):
            self.q[r["dataset"]].append(r["quality"]["value"])
        self.steps += r["steps"]
        self.committed += sum(a + 1 for a in r["accept_lengths"])
        self.seeds.add(r["seed"])

    @property
    def mat(self) -> float:
        return mean_accepted_tokens(self.committed, self.steps)

    def quality(self, dataset: str | None = None) -> tuple[float, int]:
        vals = self.q.get(dataset, []) if dataset else [v for vs in self.q.values() for v in vs]
        return (sum(vals) / len(vals) if vals else float("nan")), len(vals)


def _tps(records: list[dict]) -> float:
    """Tokens per second: per request, or per group of a batched run (``wall_s`` is then a request's latency
    beside its neighbours, so the group's own totals are used, once per group)."""
    groups = {r["batch"].get("id", r["batch"]["group"]): r["batch"] for r in records if r.get("batch")}
    if groups:
        tok, wall = sum(g["new_tokens"] for g in groups.values()), sum(g["wall_s"] for g in groups.values())
    else:
        tok, wall = sum(r["new_tokens"] for r in records), sum(r["wall_s"] for r in records)
    return tok / wall if wall else float("nan")


def rows(records: list[dict]) -> list[dict]:
    """One row per configuration (label), with its baseline's label and the comparisons."""
    groups: dict[tuple, _Group] = defaultdict(_Group)
    labels: dict[tuple, str] = {}
    for r in records:
        c = config_of(r)
        groups[c].add(r)
        labels.setdefault(c, r["label"])
    # speed: per (file/run, seed) where a configuration and its baseline both ran
    runs: dict[tuple, dict[tuple, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        runs[(r.get("_file"), r["seed"])][config_of(r)].append(r)
    out = []
    firsts: dict[tuple, dict] = {}
    for r in records:
        firsts.setdefault(config_of(r), r)
    for c, g in groups.items():
        base = baseline_of(firsts[c]) if c[1] != "lossless" else None
        rule = parse_rule(c[1])
        row = {"label": labels[c], "method": c[0][1], "verify": c[1], "lossy": rule.lossy, "sampling": c[2],
               "mat": g.mat, "quality": g.quality(), "seeds": sorted(g.seeds),
               "per_dataset": {d: g.quality(d) for d in sorted(g.q)}, "baseline": labels.get(base) if base else None}
        speed, tps, ar_ratio = [], [], []
        for cfgs in runs.values():
            # speed only from runs that also timed AR: those interleaved every method (follow-up seed runs
            # without AR only add quality and MAT)
            if c in cfgs and any(k[0][1] == "ar" for k in cfgs):
                tps.append(_tps(cfgs[c]))
                ar = next((k for k in cfgs if k[0][1] == "ar" and k[1] == "lossless" and k[2] == (0.0, 0.0)), None)
                if ar is not None:
                    ar_ratio.append(_tps(cfgs[c]) / _tps(cfgs[ar]))
                if base and base in cfgs:
                    speed.append(_tps(cfgs[c]) / _tps(cfgs[base]))
        row["tokens_per_s"] = sum(tps) / len(tps) if tps else float("nan")
        row["speedup_vs_ar"] = sum(ar_ratio) / len(ar_ratio) if ar_ratio else float("nan")
        row["speed_vs_baseline"] = sum(speed) / len(speed) if speed else float("nan")
        if base and base in groups:
            bq, _ = groups[base].quality()
            row["quality_delta"] = row["quality"][0] - bq
            row["mat_vs_baseline"] = g.mat / groups[base].mat
            # the same prompts and seeds only: paired difference
            row["paired"] = _paired(records, c, base)
        out.append(row)
    order = {"ar": 0}
    out.sort(key=lambda x: (order.get(x["method"], 1), x["lossy"], x["verify"].split(":")[1:2], x["label"]))
    return out


def _paired(records: list[dict], c: tuple, base: tuple) -> tuple[float, float, int]:
    """Mean and standard error of (rule - baseline) quality over (prompt, seed) pairs both ran."""
    a, b = {}, {}
    for r in records:
        if not r.get("quality"):
            continue
        k = (r["dataset"], r["prompt_id"], r["seed"])
        if config_of(r) == c:
            a[k] = r["quality"]["value"]
        elif config_of(r) == base:
            b[k] = r["quality"]["value"]
    d = [a[k] - b[k] for k in a if k in b]
    if not d:
        return float("nan"), float("nan"), 0
    m = sum(d) / len(d)
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1)) if len(d) > 1 else float("nan")
    return m, sd / math.sqrt(len(d)), len(d)


def _f(x: float, fmt: str = ".2f") -> str:
    return "–" if x != x else format(x, fmt)


def markdown(records: list[dict]) -> str:
    rs = rows(records)
    datasets = sorted({d for r in rs for d in r["per_dataset"]})
    head = (["Configuration", "LOSSY?"] + [f"{d} (n)" for d in datasets] +
            ["quality (n)", "MAT", "tok/s", "vs AR", "correct baseline", "Δ quality (paired ± SE, n)",
             "MAT vs base", "tok/s vs base"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rs:
        per = [f"{_f(r['per_dataset'].get(d, (math.nan, 0))[0])} ({r['per_dataset'].get(d, (0, 0))[1]})"
               for d in datasets]
        paired = r.get("paired")
        pd = f"{paired[0]:+.2f} ± {_f(paired[1])} ({paired[2]})" if paired and paired[2] else "–"
        lines.append("| " + " | ".join([
            r["label"], "**lossy**" if r["lossy"] else "lossless", *per,
            f"{_f(r['quality'][0])} ({r['quality'][1]})", _f(r["mat"]), _f(r["tokens_per_s"]),
            _f(r["speedup_vs_ar"]) + "x", r["baseline"] or "–", pd, _f(r.get("mat_vs_baseline", math.nan)) + "x",
            _f(r["speed_vs_baseline"]) + "x"]) + " |")
    return "\n".join(lines) + "\n"


def plot(records: list[dict], path: str | Path) -> Path:
    """Quality vs MAT: one line per rule over its parameter values, baselines as black markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in rows(records) if r["method"] != "ar"]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    by_rule: dict[str, list] = defaultdict(list)
    for r in rs:
        if r["lossy"]:
            by_rule[r["verify"].split(":")[1]].append(r)
        else:
            name = r["label"].split(":", 1)[-1] if r["label"] != r["method"] else "lossless SD"
            ax.scatter([r["mat"]], [r["quality"][0]], marker="s", color="black", zorder=3)
            ax.annotate(name, (r["mat"], r["quality"][0]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for name, pts in sorted(by_rule.items()):
        pts.sort(key=lambda r: r["mat"])
        ax.plot([r["mat"] for r in pts], [r["quality"][0] for r in pts], marker="o", label=f"{name} (lossy)")
        for r in pts:
            ax.annotate(r["verify"].split(":")[2], (r["mat"], r["quality"][0]), fontsize=7, xytext=(3, -9),
                        textcoords="offset points")
    ax.set_xlabel("MAT (tokens per target forward, incl. bonus)")
    ax.set_ylabel("quality (HumanEval pass@1 and GSM8K accuracy, pooled)")
    ax.set_title("Lossy rules vs lossless baselines (black squares)")
    ax.legend(fontsize=7)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
