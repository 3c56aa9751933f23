"""The lossy study's report (issue 28; ``specgraft report --study``): every point beside its correct baseline
with paired bootstrap intervals over problems, efficiency from the same records, and a verdict on each of the
paper's quality claims.

Pairing. A point and its baseline (``lossy.report.baseline_of``) are compared on the problems (dataset, prompt,
seed) both scored, so problem difficulty cancels. Intervals are percentile bootstraps over those problems
(``REPS`` resamples, fixed seed); speed ratios are bootstrapped over the run's groups instead (the conversations
of one point that were in flight together, ``BenchConfig.batch``; a record is its own group when the run was
not batched), pairing a point's group with the reference's group on the same problems.

Verdicts (docs/lossy.md states them beside the table):

- a claimed **drop** (CoS, interpolation alone, truncation on trees more than on chains) is *reproduced* when the
  interval lies below 0, *contradicted* when it excludes even half the paper's drop, else *unresolved*;
- a claimed **no drop** (lenience, the cap) is *reproduced* when the interval's lower end is above ``-MARGIN``
  (non-inferior within 3 points), *contradicted* when the interval lies below 0, else *unresolved*;
- the combined rule's claim needs both: no drop, and a MAT gain whose interval lies above 1;
- fewer than ``MIN_N`` paired problems give no verdict.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ..lossy.report import baseline_of, config_of
from ..lossy.rules import parse_rule
from ..registry import chain_drafter
from .report_stats import Estimate, ratio_of_ratios

REPS = 10_000
MARGIN = 0.03  # 3 points: the standard-error goal, used as the non-inferiority margin
SE_GOAL = 0.03
MIN_N = 100  # fewer paired problems give no verdict (a handful of identical answers is a zero-width interval)


def _problem(r: dict) -> tuple:
    return r["dataset"], r["prompt_id"], r["seed"]


def _is_tree(config: tuple) -> bool:
    """Deterministic candidates (EAGLE-3 heads, draft-model or Graft trees: the q = 1 gates), not a chain that
    carries the draft's q."""
    method, options = config[0][1], dict(x.split("=", 1) for x in config[0][2])
    return method != "ar" and not chain_drafter(method, options)


@dataclass
class Point:
    """One configuration's records, indexed by problem (its last turn carries the score)."""

    config: tuple
    label: str
    quality: dict  # problem -> score (0/1)
    dataset: dict  # problem -> dataset name
    committed: dict  # problem -> tokens committed over its turns (incl. bonus)
    steps: dict  # problem -> target forwards
    groups: dict  # group key -> (new tokens, wall seconds)
    group_of: dict  # problem -> group key
    members: dict  # group key -> the problems it decoded (a frozenset once built)

    @property
    def mat(self) -> float:
        steps = sum(self.steps.values())
        return sum(self.committed.values()) / steps if steps else math.nan

    @property
    def tokens_per_s(self) -> float:
        tok = sum(t for t, _ in self.groups.values())
        wall = sum(w for _, w in self.groups.values())
        return tok / wall if wall else math.nan


def points(records: list[dict]) -> dict[tuple, Point]:
    out: dict[tuple, Point] = {}
    for r in records:
        c = config_of(r)
        p = out.setdefault(c, Point(c, r["label"], {}, {}, defaultdict(int), defaultdict(int), {}, {},
                                    defaultdict(set)))
        k = _problem(r)
        p.dataset[k] = r["dataset"]
        p.committed[k] += sum(a + 1 for a in r["accept_lengths"])
        p.steps[k] += r["steps"]
        if r.get("quality"):
            p.quality[k] = float(r["quality"]["value"])
        batch = r.get("batch")
        if batch:  # every record of a group carries the group's totals; ``id`` tells a resumed group's rerun apart
            g = (r.get("_file"), batch.get("id", (r["seed"], batch["group"])))
            p.groups[g] = (batch["new_tokens"], batch["wall_s"])
        else:
            g = (r.get("_file"), k)
            tok, wall = p.groups.get(g, (0, 0.0))
            p.groups[g] = (tok + r["new_tokens"], wall + r["wall_s"])
        p.group_of[k] = g
        p.members[g].add(k)
    for p in out.values():
        p.members = {g: frozenset(ks) for g, ks in p.members.items()}
    return out


def _as_dict(e: Estimate) -> dict:
    return {"ratio": e.point, "lo": e.lo, "hi": e.hi, "n": e.n}


def _mean_interval(d: np.ndarray) -> dict:
    """Mean of the per-problem differences ``d``, its standard error and bootstrap interval (``report_stats``'s
    ratio of sums with unit denominators)."""
    n = len(d)
    ones = np.ones(n)
    e = ratio_of_ratios(d, ones, ones, ones, resamples=REPS)
    se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    return {"mean": e.point, "se": se, "lo": e.lo if n > 1 else math.nan, "hi": e.hi if n > 1 else math.nan, "n": n}


def problems_for_se(d: dict, goal: float = SE_GOAL) -> int | None:
    """Paired problems the same per-problem spread would need for a standard error of ``goal``
    (``n se^2 / goal^2``: the SE shrinks as 1/sqrt(n)); None without a spread yet. Tells whether the planned
    problem set (and one seed) can meet the issue's SE goal before the run ends."""
    if not d or d.get("n", 0) < 2 or d["se"] != d["se"]:
        return None
    return max(d["n"], math.ceil(d["n"] * (d["se"] / goal) ** 2 - 1e-9))


def paired_quality(a: Point, b: Point) -> dict:
    """Mean of (a - b) over the problems both scored, its standard error and bootstrap interval."""
    keys = sorted(set(a.quality) & set(b.quality))
    return _mean_interval(np.array([a.quality[k] - b.quality[k] for k in keys], dtype=float))


def gap_difference(rule_t: Point, base_t: Point, rule_c: Point, base_c: Point) -> dict:
    """(tree rule - tree baseline) - (chain rule - chain baseline), per problem all four scored."""
    keys = sorted(set(rule_t.quality) & set(base_t.quality) & set(rule_c.quality) & set(base_c.quality))
    return _mean_interval(np.array([(rule_t.quality[k] - base_t.quality[k]) - (rule_c.quality[k] - base_c.quality[k])
                                    for k in keys], dtype=float))


def mat_ratio(a: Point, b: Point) -> dict:
    """MAT of a over MAT of b on the problems both ran (ratio of pooled sums), bootstrap over problems."""
    keys = sorted(set(a.steps) & set(b.steps))
    return _as_dict(ratio_of_ratios(*([m[k] for k in keys] for m in (a.committed, a.steps, b.committed, b.steps)),
                                    resamples=REPS))


def speed_ratio(a: Point, ref: Point) -> dict:
    """Throughput of a over ref, pairing each group of a with ref's group that decoded exactly the same problems
    in the same run (file), bootstrap over those pairs."""
    pairs = {}
    for k, g in a.group_of.items():
        h = ref.group_of.get(k)
        if h is not None and g[0] == h[0] and a.members[g] == ref.members[h]:
            pairs[g] = h
    rows = [(*a.groups[g], *ref.groups[h]) for g, h in pairs.items()]
    return _as_dict(ratio_of_ratios(*(list(x) for x in zip(*rows)) if rows else ([], [], [], []), resamples=REPS))


def _ar(pts: dict[tuple, Point]) -> Point | None:
    return next((p for c, p in pts.items() if c[0][1] == "ar" and c[1] == "lossless" and c[2] == (0.0, 0.0)), None)


def study_rows(records: list[dict]) -> list[dict]:
    pts = points(records)
    ar = _ar(pts)
    rows = []
    for c, p in pts.items():
        base = pts.get(baseline_of(next(r for r in records if config_of(r) == c))) if c[1] != "lossless" else None
        per = defaultdict(list)
        for k, v in p.quality.items():
            per[p.dataset[k]].append(v)
        row = {"label": p.label, "config": c, "lossy": parse_rule(c[1]).lossy, "tree": _is_tree(c),
               "per_dataset": {d: (sum(v) / len(v), len(v)) for d, v in sorted(per.items())},
               "mat": p.mat, "tokens_per_s": p.tokens_per_s, "baseline": base.label if base else None,
               "vs_ar": speed_ratio(p, ar) if ar is not None and p is not ar else None}
        if base is not None:
            row.update(delta=paired_quality(p, base), mat_vs_base=mat_ratio(p, base), speed_vs_base=speed_ratio(p, base))
        rows.append(row)
    rows.sort(key=lambda r: (r["config"][0][1] != "ar", r["lossy"], r["tree"], r["label"]))
    return rows


def _pts(x: float) -> str:
    return "–" if x != x else f"{100 * x:+.1f}"


def _ci(d: dict | None, pts: bool = False, fmt: str = ".2f") -> str:
    if not d or not d.get("n"):
        return "–"
    f = _pts if pts else (lambda v: "–" if v != v else format(v, fmt))
    centre = d["mean"] if "mean" in d else d["ratio"]
    return f"{f(centre)} [{f(d['lo'])}, {f(d['hi'])}]"


def markdown(records: list[dict], distortion: dict | None = None) -> str:
    """The per-point table; ``distortion``: ``tools.distortion.aggregate`` rows for the same rules, if measured."""
    rows = study_rows(records)
    datasets = sorted({d for r in rows for d in r["per_dataset"]})
    head = (["point", "LOSSY?", "mode"] + [f"{d} (n)" for d in datasets] +
            ["correct baseline", "Δ quality, points [95% CI]", "SE", "n", "n for SE 3", "MAT", "MAT vs base [CI]",
             "tok/s", "vs AR [CI]", "vs base [CI]", "TV", "KL(π‖b)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        per = [f"{r['per_dataset'][d][0]:.3f} ({r['per_dataset'][d][1]})" if d in r["per_dataset"] else "–"
               for d in datasets]
        delta = r.get("delta")
        dist = (distortion or {}).get(("tree" if r["tree"] else "chain", r["config"][1])) if r["lossy"] else None
        se = delta["se"] if delta else math.nan
        lines.append("| " + " | ".join([
            r["label"], "**lossy**" if r["lossy"] else "lossless",
            "–" if r["config"][0][1] == "ar" else "tree" if r["tree"] else "chain", *per,
            r["baseline"] or "–", _ci(delta, pts=True),
            "–" if se != se else f"{100 * se:.1f}{'' if se <= SE_GOAL else ' (> 3)'}",
            str(delta["n"]) if delta else "–", str(problems_for_se(delta) or "–"), f"{r['mat']:.2f}",
            _ci(r.get("mat_vs_base")), f"{r['tokens_per_s']:.1f}", _ci(r["vs_ar"]), _ci(r.get("speed_vs_base")),
            f"{dist['tv']:.3f}" if dist else "–", f"{dist['kl_pi_b']:.3f}" if dist else "–"]) + " |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Claim:
    text: str
    kind: str  # "drop", "keep", "keep_faster", "tree_vs_chain"
    rule: str  # the rule spec of the point (chain mode unless tree_vs_chain: then both modes of its rule name)
    paper: str  # the paper's number, as it reports it
    paper_drop: float = 0.0  # the paper's drop (a fraction, negative) for "drop" / "tree_vs_chain"


CLAIMS = [
    Claim("Truncation verification distorts more on trees than on chains: SpecCascade", "tree_vs_chain",
          "lossy:speccascade:0.1", "gap to min-p −0.38 (one draft) → −1.68 points (EAGLE-3), mean over p_base",
          -0.0130),
    Claim("Truncation verification distorts more on trees than on chains: typical acceptance", "tree_vs_chain",
          "lossy:typical:0.1", "gap to eta −0.32 (one draft) → −6.32 points (EAGLE-3), mean over eps", -0.0600),
    Claim("Collaborative rules overshoot: CoS (draft weight 0.6) loses quality", "drop", "lossy:cos:0.4",
          "MBPP+ 59.44 vs 75.84 lossless (−16.4 points)", -0.164),
    Claim("Lenience (l = 0.6) keeps quality", "keep", "lossy:lenience:0.6", "MBPP+ 75.57 vs 75.84 (−0.3 points)"),
    Claim("Lenience (l = 0.2) keeps quality", "keep", "lossy:lenience:0.2", "MBPP+ 75.13 vs 75.84 (−0.7 points)"),
    Claim("The overshoot cap protects quality (cap-only, λ = 0.2)", "keep", "lossy:cap:0.2",
          "MBPP+ 75.13–75.93 vs 75.84 over λ (≈ 0), about +3% efficiency"),
    Claim("Interpolation alone collapses (interp-only, λ = 0.2)", "drop", "lossy:interp:0.2",
          "MBPP+ 50.26 vs 75.84 (−25.6 points)", -0.256),
    Claim("The combined rule keeps quality at higher acceptance (min-p 0.3 inside, cap l = 0.5 outside)",
          "keep_faster", "lossy:combined:0.3", "MBPP+ 75.66 vs 75.66, +3.7% efficiency"),
]


def _find(rows: list[dict], rule: str, tree: bool) -> dict | None:
    """The row of ``rule`` (its spec, or its spec's name:param prefix) in the given mode."""
    for r in rows:
        spec = r["config"][1]
        if r["lossy"] and r["tree"] == tree and (spec == rule or spec.startswith(rule + ":")):
            return r
    return None


def verdict(claim: Claim, rows: list[dict], pts: dict[tuple, Point]) -> tuple[str, str]:
    """(ours, verdict) for one claim."""
    chain = _find(rows, claim.rule, tree=False)
    if claim.kind == "tree_vs_chain":
        tree = _find(rows, claim.rule, tree=True)
        if not (chain and tree and chain.get("delta") and tree.get("delta")):
            return "not measured", "unresolved (missing points)"
        by = {p.label: p for p in pts.values()}
        d = gap_difference(by[tree["label"]], by[tree["baseline"]], by[chain["label"]], by[chain["baseline"]])
        ours = (f"gap chain {_ci(chain['delta'], pts=True)}, tree {_ci(tree['delta'], pts=True)}; "
                f"tree − chain {_ci(d, pts=True)} (n = {d['n']})")
        return ours, _drop_verdict(d, claim.paper_drop)
    if not (chain and chain.get("delta")):
        return "not measured", "unresolved (missing point)"
    d = chain["delta"]
    ours = f"Δ {_ci(d, pts=True)} points (SE {_pts(d['se']).lstrip('+')}, n = {d['n']})"
    if claim.kind == "drop":
        return ours, _drop_verdict(d, claim.paper_drop)
    quality = _keep_verdict(d)
    if claim.kind == "keep":
        return ours, quality
    m = chain["mat_vs_base"]
    ours += f"; MAT {_ci(m)}x"
    if d["n"] < MIN_N:
        return ours, quality
    if quality.startswith("reproduced") and m["lo"] > 1:
        return ours, "reproduced (no drop beyond 3 points, and a MAT gain)"
    if quality.startswith("contradicted") or m["hi"] < 1:
        return ours, "contradicted (" + ("a quality drop" if quality.startswith("contradicted") else "no MAT gain") + ")"
    return ours, "unresolved at this scale"


def _drop_verdict(d: dict, paper_drop: float) -> str:
    if d["n"] < MIN_N:
        return f"unresolved (n = {d['n']} < {MIN_N} paired problems)"
    if d["hi"] < 0 and d["lo"] > paper_drop / 2:
        return (f"reproduced in direction, smaller than claimed (a drop, but the interval excludes half the "
                f"paper's, {100 * paper_drop / 2:.1f} points)")
    if d["hi"] < 0:
        return "reproduced (a drop: the interval lies below 0)"
    if d["lo"] > paper_drop / 2:
        return f"contradicted (the interval excludes half the paper's drop, {100 * paper_drop / 2:.1f} points)"
    return "unresolved at this scale"


def _keep_verdict(d: dict) -> str:
    if d["n"] < MIN_N:
        return f"unresolved (n = {d['n']} < {MIN_N} paired problems)"
    if d["lo"] > -MARGIN:
        return "reproduced (no drop beyond 3 points)"
    if d["hi"] < 0:
        return "contradicted (a drop: the interval lies below 0)"
    return "unresolved at this scale"


def verdict_table(records: list[dict]) -> str:
    rows, pts = study_rows(records), points(records)
    lines = ["| paper's claim | the paper | ours (95% CI, paired over problems) | verdict |", "|---|---|---|---|"]
    for claim in CLAIMS:
        ours, v = verdict(claim, rows, pts)
        lines.append(f"| {claim.text} | {claim.paper} | {ours} | **{v}** |")
    return "\n".join(lines) + "\n"
