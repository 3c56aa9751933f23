"""Paired bootstrap statistics for ``specgraft report``: speedups and MAT with 95% intervals over prompts,
the per-prompt table, goals (``LABEL>REF:RATIO``), measured noise between identical configurations, and
provenance (commits, calibration).

The resampling unit is the prompt key (dataset, prompt_id, seed): all turns of a conversation move together.
A comparison of two labels uses only the keys both have. The statistic is the per-token time ratio of
:func:`specgraft.eval.report.speedup`, a ratio of sums over the resampled prompts (not a mean of ratios); MAT is
committed tokens over target forwards, also a ratio of sums.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from ..core.stats import mean_accepted_tokens
from ..errors import SpecgraftError

RESAMPLES = 10_000
SEED = 0
_CHUNK = 1_000  # resamples per block, to bound memory on large runs


def prompt_key(r: dict) -> tuple:
    return r["dataset"], r["prompt_id"], r["seed"]


def key_name(k: tuple) -> str:
    return f"{k[0]}/{k[1]}" + (f"/s{k[2]}" if k[2] else "")


@dataclass
class Agg:
    """Sums over records (one label, one group or one prompt): tokens, wall time, steps, the time split,
    per-depth trials and accepts, quality scores."""

    n: int = 0
    tokens: int = 0
    wall: float = 0.0
    steps: int = 0
    committed: int = 0
    prefill: float = 0.0
    draft: float = 0.0
    verify: float = 0.0
    other: float = 0.0
    nodes: int = 0
    trials: list[int] = field(default_factory=list)
    accepts: list[int] = field(default_factory=list)
    quality: list[float] = field(default_factory=list)

    def add(self, r: dict) -> None:
        self.n += 1
        self.tokens += r["new_tokens"]
        self.wall += r["wall_s"]
        self.steps += r["steps"]
        self.committed += sum(a + 1 for a in r["accept_lengths"])
        self.prefill += r["prefill_s"]
        self.draft += r["draft_s"]
        self.verify += r["verify_s"]
        self.other += r["other_s"]
        self.nodes += r["tree_nodes"]
        for name, src in (("trials", r["depth_trials"]), ("accepts", r["depth_accepts"])):
            dst = getattr(self, name)
            dst.extend([0] * (len(src) - len(dst)))
            for i, v in enumerate(src):
                dst[i] += v
        if r.get("quality"):
            self.quality.append(r["quality"]["value"])

    @property
    def mat(self) -> float:
        return mean_accepted_tokens(self.committed, self.steps)

    @property
    def alpha(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.accepts, self.trials)]


def per_prompt(records: list[dict]) -> dict:
    """{label: {prompt key: Agg}}, turns of a conversation summed."""
    out: dict = {}
    for r in records:
        out.setdefault(r["label"], {}).setdefault(prompt_key(r), Agg()).add(r)
    return out


@dataclass
class Estimate:
    point: float
    lo: float
    hi: float
    n: int  # prompts

    def fmt(self, unit: str = "x") -> str:
        if self.n == 0 or math.isnan(self.point):
            return "n/a"
        return f"{self.point:.2f}{unit} [{self.lo:.2f}, {self.hi:.2f}]"


def _counts(n: int, resamples: int, seed: int):
    """Blocks of resample counts: row b says how often each prompt is drawn in resample b."""
    rng = np.random.default_rng(seed)
    left = resamples
    while left > 0:
        m = min(_CHUNK, left)
        idx = rng.integers(0, n, size=(m, n)) + (np.arange(m) * n)[:, None]
        yield np.bincount(idx.ravel(), minlength=m * n).reshape(m, n).astype(float)
        left -= m


def ratio_of_ratios(num_a, den_a, num_b, den_b, resamples: int = RESAMPLES, seed: int = SEED) -> Estimate:
    """``(sum num_a / sum den_a) / (sum num_b / sum den_b)`` over paired prompts, with a bootstrap 95%
    percentile interval (prompts resampled with replacement). Pass ``num_b = den_b = 1`` arrays for a plain
    ratio of sums."""
    arrs = [np.asarray(x, dtype=float) for x in (num_a, den_a, num_b, den_b)]
    n = len(arrs[0])
    if n == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)

    def stat(sums):
        na, da, nb, db = sums
        with np.errstate(divide="ignore", invalid="ignore"):
            return (na / da) / (nb / db)

    point = float(stat([a.sum() for a in arrs]))
    vals = np.concatenate([stat([c @ a for a in arrs]) for c in _counts(n, resamples, seed)])
    vals = vals[np.isfinite(vals)]
    if not len(vals):
        return Estimate(point, float("nan"), float("nan"), n)
    lo, hi = np.percentile(vals, [2.5, 97.5])
    # Identical prompts give a degenerate distribution; keep the interval exactly on the point.
    return Estimate(point, min(float(lo), point), max(float(hi), point), n)


def paired(pp: dict, a: str, b: str) -> list[tuple]:
    return sorted(set(pp.get(a, {})) & set(pp.get(b, {})), key=str)


def speedup_ci(pp: dict, label: str, base: str, **kw) -> Estimate:
    """Per-token speedup of ``label`` over ``base``: (T_base / n_base) / (T_label / n_label)."""
    keys = paired(pp, label, base)
    m, b = [pp[label][k] for k in keys], [pp[base][k] for k in keys]
    return ratio_of_ratios([x.wall for x in b], [x.tokens for x in b], [x.wall for x in m], [x.tokens for x in m],
                           **kw)


def _steps(s: Agg) -> tuple[float, float]:
    return s.committed, s.steps  # MAT = their ratio (core.stats.mean_accepted_tokens), pooled over prompts


def mat_ci(pp: dict, label: str, keys: list | None = None, **kw) -> Estimate:
    keys = sorted(pp.get(label, {}), key=str) if keys is None else keys
    cs = [_steps(pp[label][k]) for k in keys]
    ones = [1.0] * len(cs)
    return ratio_of_ratios([c for c, _ in cs], [s for _, s in cs], ones, ones, **kw)


def mat_ratio_ci(pp: dict, label: str, base: str, **kw) -> Estimate:
    keys = paired(pp, label, base)
    a, b = [_steps(pp[label][k]) for k in keys], [_steps(pp[base][k]) for k in keys]
    return ratio_of_ratios([c for c, _ in a], [s for _, s in a], [c for c, _ in b], [s for _, s in b], **kw)


# --- goals ---------------------------------------------------------------------------------------------------

@dataclass
class Goal:
    label: str
    ref: str
    ratio: float
    metric: str = "speed"  # or "mat"
    text: str = ""


def parse_goal(text: str) -> Goal:
    """``LABEL>REF:RATIO`` (speed) or ``mat:LABEL>REF:RATIO``; labels may contain ':' but not '>'."""
    bad = SpecgraftError(f"bad --goal '{text}': expected LABEL>REF:RATIO (e.g. graft>eagle:1.15, REF may be ar), "
                         "optionally prefixed by mat:")
    head, sep, ratio = text.strip().rpartition(":")
    if not sep or head.count(">") != 1:
        raise bad
    try:
        r = float(ratio)
    except ValueError:
        raise bad from None
    if not math.isfinite(r) or r <= 0:
        raise bad
    label, ref = (x.strip() for x in head.split(">"))
    metric = "speed"
    if label.startswith("mat:"):
        metric, label = "mat", label[4:].strip()
    if not label or not ref:
        raise bad
    return Goal(label, ref, r, metric, text.strip())


def resolve_goal(goal: Goal, labels: list[str]) -> Goal:
    """A label literally named ``mat:...`` wins over the MAT prefix."""
    if goal.metric == "mat" and "mat:" + goal.label in labels:
        return Goal("mat:" + goal.label, goal.ref, goal.ratio, "speed", goal.text)
    return goal


def check_labels(labels: list[str], reference: str | None, goals: list[Goal]) -> list[Goal]:
    known = ", ".join(labels)
    if reference is not None and reference not in labels:
        raise SpecgraftError(f"unknown reference label '{reference}' (labels: {known})")
    out = []
    for g in goals:
        g = resolve_goal(g, labels)
        for x in (g.label, g.ref):
            if x not in labels:
                raise SpecgraftError(f"--goal '{g.text}': unknown label '{x}' (labels: {known})")
        out.append(g)
    return out


def goal_lines(pp: dict, goals: list[Goal]) -> list[str]:
    if not goals:
        return []
    lines = ["", "## Goals", "", "A goal is met only when the lower bound of the 95% bootstrap interval clears "
             "the ratio.", ""]
    for g in goals:
        est = mat_ratio_ci(pp, g.label, g.ref) if g.metric == "mat" else speedup_ci(pp, g.label, g.ref)
        what = "MAT ratio" if g.metric == "mat" else "speedup"
        if est.n == 0:
            verdict = "not met (no paired prompts)"
        elif est.lo >= g.ratio:
            verdict = "met"
        else:
            verdict = f"not met (lower bound {est.lo:.3f})"
        lines.append(f"- `{g.text}`: {what} of {g.label} over {g.ref} >= {g.ratio:g}: {est.fmt()} "
                     f"on {est.n} prompts: **{verdict}**")
    return lines


# --- tables ----------------------------------------------------------------------------------------------------

def _ar_name(ar_label: str | None) -> str:
    return "AR" if ar_label in (None, "ar") else ar_label


def interval_table(pp: dict, labels: list[str], reference: str | None, groups: dict | None = None,
                   ar_label: str | None = "ar") -> list[str]:
    """Overall rows, then one block per group (``{name: prompt keys}``, e.g. per category) when there are
    several: each group's intervals resample only its own prompts. ``ar_label``: the run's AR (``ar``, or e.g.
    ``llama-ar`` in a run without that label)."""
    has_ar = ar_label in pp
    head = f"| group | method | prompts | speedup vs {_ar_name(ar_label)} [95% CI] |"
    sep = "|---|---|---|---|"
    if reference:
        head += f" speedup vs {reference} [95% CI] |"
        sep += "---|"
    lines = ["", f"## Speedup and MAT with 95% bootstrap intervals ({RESAMPLES} resamples of prompts, paired)", "",
             head + " MAT [95% CI] |", sep + "---|"]
    blocks = [("all", pp)]
    if groups and len(groups) > 1:
        blocks += [(g, {lab: {k: v for k, v in per.items() if k in keys} for lab, per in pp.items()})
                   for g, keys in groups.items()]
    for group, sub in blocks:
        for label in labels:
            if not sub.get(label):
                continue
            vs_ar = speedup_ci(sub, label, ar_label) if has_ar else None
            keys = paired(sub, label, ar_label) if has_ar else None
            mat = mat_ci(sub, label, keys)
            row = f"| {group} | {label} | {mat.n} | {vs_ar.fmt() if vs_ar else 'n/a (no AR)'} |"
            if reference:
                row += " - |" if label == reference else f" {speedup_ci(sub, label, reference).fmt()} |"
            lines.append(row + f" {mat.fmt('')} |")
    n = max((len(x) for x in pp.values()), default=0)
    if n < 10 or len(blocks) > 1:
        lines += ["", f"- Percentile intervals from fewer than 10 prompts ({n} overall; fewer in each group) are too "
                  "narrow; read them as rough."]
    return lines


def prompt_table(pp: dict, labels: list[str], ar_label: str | None = "ar") -> list[str]:
    """One row per prompt key; per method ``speedup vs AR / MAT`` (AR: ``ar_label``, the run's AR)."""
    methods = [x for x in labels if x != ar_label and x in pp]
    keys = sorted({k for x in pp.values() for k in x}, key=str)
    if not methods or not keys:
        return []
    name = _ar_name(ar_label)
    lines = ["", f"## Per prompt (speedup vs {name} / MAT; all turns of a conversation together)", "",
             f"| prompt | {name} tok/s | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for k in keys:
        ar = pp.get(ar_label, {}).get(k)
        cells = [f"{ar.tokens / ar.wall:.1f}" if ar and ar.wall else "-"]
        for m in methods:
            s = pp[m].get(k)
            if s is None:
                cells.append("-")
                continue
            c, st = _steps(s)
            sp = (ar.wall / ar.tokens) / (s.wall / s.tokens) if ar and ar.tokens and s.wall and s.tokens else None
            cells.append((f"{sp:.2f}x" if sp is not None else "-") + f" / {c / st if st else 1.0:.2f}")
        lines.append(f"| {key_name(k)} | " + " | ".join(cells) + " |")
    return lines


def _spec_id(r: dict) -> str | None:
    return json.dumps(r["spec"], sort_keys=True, default=str) if r.get("spec") is not None else None


def noise_pairs(records: list[dict], labels: list[str]) -> list[tuple[str, str]]:
    """Pairs (first label, other label) of labels whose records carry one identical ``spec``."""
    specs: dict = {}
    for r in records:
        specs.setdefault(r["label"], set()).add(_spec_id(r))
    groups: dict = {}
    for label in labels:
        s = specs.get(label, set())
        if len(s) == 1 and None not in s:
            groups.setdefault(next(iter(s)), []).append(label)
    return [(g[0], other) for g in groups.values() if len(g) > 1 for other in g[1:]]


def noise_lines(pp: dict, pairs: list[tuple[str, str]]) -> list[str]:
    if not pairs:
        return []
    lines = ["", "### Measured noise (labels with identical configuration in one run)", "",
             "| pair | prompts | speed ratio [95% CI] | per-prompt ratio: median, range, sd |", "|---|---|---|---|"]
    for a, b in pairs:
        est = speedup_ci(pp, b, a)
        rs = np.array([(pp[a][k].wall / pp[a][k].tokens) / (pp[b][k].wall / pp[b][k].tokens)
                       for k in paired(pp, a, b) if pp[a][k].tokens and pp[b][k].tokens and pp[b][k].wall])
        spread = (f"{np.median(rs):.3f}, [{rs.min():.3f}, {rs.max():.3f}], {rs.std(ddof=1) if len(rs) > 1 else 0:.3f}"
                  if len(rs) else "-")
        lines.append(f"| {b} vs {a} | {est.n} | {est.fmt()} | {spread} |")
    lines.append("")
    lines.append("A speed ratio away from 1.00x between identical configurations is machine noise; read speedup "
                 "differences smaller than this spread as ties.")
    return lines


# --- provenance ------------------------------------------------------------------------------------------------

def commit_lines(records: list[dict]) -> list[str]:
    by: dict = {}
    for r in records:
        by.setdefault((str(r.get("commit")), bool(r.get("dirty"))), []).append(r["label"])
    items = []
    for (commit, dirty), labels in sorted(by.items()):
        name = commit + (" (dirty tree: uncommitted changes)" if dirty else "")
        if len(by) > 1:
            name += f" [{', '.join(dict.fromkeys(labels))}]"
        items.append(name)
    return [f"- commit(s): {'; '.join(items)}"]


def machine_lines(records: list[dict]) -> list[str]:
    """One line per distinct machine and library versions, with its record count when a file mixes them (a
    study resumed across sessions: each ratio is still paired within one run on one machine)."""
    by: dict = {}
    for r in records:
        m = r.get("machine") or {}
        cpu = m.get('cpu', 'unknown') + (f" (family-model {m['cpu_id']})" if m.get("cpu_id") else "")
        name = (f"{cpu}, {m.get('cores', '?')} cores, {m.get('threads', '?')} threads, "
                f"AMX {m.get('amx', 'not recorded')}, vector ISA {m.get('isa', 'not recorded')}; "
                f"versions: {r.get('versions')}")
        by[name] = by.get(name, 0) + 1
    if len(by) == 1:
        return [f"- machine: {next(iter(by))}"]
    return ["- machines (records were written on several; every ratio is paired within one group on one machine):",
            *(f"  - {name} ({n} records)" for name, n in by.items())]


def _fmt_value(v) -> str:
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v)


def calibration_lines(records: list[dict], labels: list[str]) -> list[str]:
    rows = []
    for label in labels:
        seen = []
        for r in records:
            info = (r.get("method_config") or {}).get("drafter", {}).get("calibration_info")
            if r["label"] == label and isinstance(info, dict) and info not in seen:
                seen.append(info)
        for info in seen:
            rows.append(f"- {label}: " + ", ".join(f"{k}: {_fmt_value(v)}" for k, v in info.items()))
    return ["", "## Calibration", ""] + rows if rows else []
