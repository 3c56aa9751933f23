"""``specgraft report``: tables, an exactness check and plots from harness records.

Speedups come only from records in the same file(s), on the keys (dataset, prompt, turn, seed) that both AR
and the method have: greedy ``T_AR / T_method``; sampling per-token ``(T_AR/n_AR) / (T_method/n_method)``.
MAT includes the bonus token (AR = 1). Intervals, goals, measured noise and provenance: :mod:`.report_stats`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from . import report_stats as rs
from .report_stats import Agg
from .harness import complete_conversations, read_records


def _key(r: dict) -> tuple:
    return r["dataset"], r["prompt_id"], r["turn"], r["seed"]


def speedup(base: Agg, other: Agg) -> float:
    """Per-token time ratio. With identical outputs (greedy, fp32) it equals ``T_AR / T_method``; when
    outputs differ (sampling, or bf16 near-ties under greedy) it stays fair where the wall ratio would not."""
    if not other.wall or not base.wall or not other.tokens or not base.tokens:
        return float("nan")
    return (base.wall / base.tokens) / (other.wall / other.tokens)


@dataclass
class Report:
    records: list[dict]
    problems: list[str]
    labels: list[str]
    mismatches: dict  # label -> list of (key, first differing index)
    missing: list[str]
    unchecked: list[str] = field(default_factory=list)  # greedy lossless labels with no AR on their weights

    @property
    def ok(self) -> bool:
        return not self.problems and not self.missing


def load(paths: list[str]) -> Report:
    records, problems = [], []
    for p in paths:
        recs, probs = read_records(p)
        problems += probs
        kept, _ = complete_conversations(recs)
        if len(kept) < len(recs):
            problems.append(f"{p}: {len(recs) - len(kept)} record(s) of incomplete conversations")
        records += kept
    labels = list(dict.fromkeys(r["label"] for r in records))
    if "ar" in labels:
        labels.remove("ar")
        labels.insert(0, "ar")
    mismatches, missing = exactness(records, labels)
    return Report(records, problems, labels, mismatches, missing, unchecked(records, labels))


def _engine(r: dict) -> tuple:
    """The weights a record ran on: its AR reference must share them."""
    return r.get("backend", "transformers"), r.get("dtype")


def ar_references(records: list[dict], labels: list[str]) -> dict[str, str | None]:
    """Label -> the AR label its greedy output is checked against: the first AR label (``ar`` first) that ran on
    the same backend and weights, which for that AR label is itself (it is the reference); None when no AR ran
    on them (a run may hold one AR per backend)."""
    engines = {r["label"]: _engine(r) for r in records}
    ars = [label for label in labels if any(r["label"] == label and r["method"] == "ar" for r in records)]
    ars.sort(key=lambda label: label != "ar")
    return {label: next((a for a in ars if engines.get(a) == engines.get(label)), None) for label in labels}


def unchecked(records: list[dict], labels: list[str]) -> list[str]:
    """Greedy lossless labels with no AR on their backend and weights: their outputs were not checked."""
    refs = ar_references(records, labels)
    return [label for label in labels if refs[label] is None
            and any(r["label"] == label and r["greedy"] and not r.get("lossy") for r in records)]


def exactness(records: list[dict], labels: list[str]) -> tuple[dict, list[str]]:
    """Greedy, lossless records must equal their AR reference's token ids on the same key (``ar_references``);
    every key needs every label."""
    by = {(r["label"], _key(r)): r for r in records}
    keys = sorted({_key(r) for r in records}, key=str)
    refs = ar_references(records, labels)
    mismatches: dict = defaultdict(list)
    missing = []
    for k in keys:
        for label in labels:
            if (label, k) not in by:
                missing.append(f"{label} has no record for {k}")
        for label in labels:
            r, ar = by.get((label, k)), by.get((refs[label], k))
            if ar is None or r is None or refs[label] == label or not r["greedy"] or r.get("lossy"):
                continue
            if r["output_ids"] != ar["output_ids"]:
                first = next((i for i, (a, b) in enumerate(zip(ar["output_ids"], r["output_ids"])) if a != b),
                             min(len(ar["output_ids"]), len(r["output_ids"])))
                mismatches[label].append((k, first))
    return dict(mismatches), missing


def baseline(records: list[dict], labels: list[str], reference: str | None = None) -> str | None:
    """The label the tables' speedups divide by: ``reference`` when given, else ``ar``, else the first AR label
    (a run whose AR is labelled ``llama-ar``), else None."""
    if reference:
        return reference
    if "ar" in labels:
        return "ar"
    return next((lb for lb in labels if any(r["label"] == lb and r["method"] == "ar" for r in records)), None)


def aggregate(records: list[dict], labels: list[str], group, base: str | None = "ar") -> dict:
    """{group value: {label: Agg}} over keys present for the baseline and the label (paired comparison)."""
    by = {(r["label"], _key(r)): r for r in records}
    out: dict = defaultdict(lambda: defaultdict(Agg))
    for r in records:
        if r["label"] != base and (base, _key(r)) not in by:
            continue
        out[group(r)][r["label"]].add(r)
    return out


def _table(groups: dict, labels: list[str], base_label: str | None = "ar") -> list[str]:
    lines = [f"| group | method | turns | tokens | tok/s | speedup vs {base_label or 'AR'} | MAT | alpha by depth (1..6) "
             "| mean nodes | prefill / draft / verify / other (s) | quality |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for g, aggs in groups.items():
        base = aggs.get(base_label)
        for label in labels:
            a = aggs.get(label)
            if a is None or a.n == 0:
                continue
            sp = speedup(base, a) if base else float("nan")
            alpha = ", ".join(f"{x:.2f}" for x in a.alpha[:6]) or "-"
            q = f"{sum(a.quality) / len(a.quality):.3f} (n={len(a.quality)})" if a.quality else "-"
            lines.append(f"| {g} | {label} | {a.n} | {a.tokens} | {a.tokens / a.wall:.2f} | {sp:.2f}x | {a.mat:.2f} | "
                         f"{alpha} | {a.nodes / max(a.steps, 1):.1f} | {a.prefill:.1f} / {a.draft:.1f} / "
                         f"{a.verify:.1f} / {a.other:.1f} | {q} |")
    return lines


def _interval_groups(recs: list[dict]) -> dict:
    """Prompt keys per dataset, split by category where every category of that dataset has >= 2 prompts
    (MT-Bench's one prompt per category stays one group)."""
    by_cat: dict = defaultdict(lambda: defaultdict(set))
    for r in recs:
        by_cat[r["dataset"]][r["category"]].add(rs.prompt_key(r))
    out = {}
    for dataset, cats in by_cat.items():
        if len(cats) > 1 and all(len(keys) >= 2 for keys in cats.values()):
            out.update({f"{dataset}/{c}": keys for c, keys in cats.items()})
        else:
            out[dataset] = set().union(*cats.values())
    return out


def _graft_table(recs: list[dict], labels: list[str]) -> list[str]:
    """Graft / pruning instrumentation summed over records: stages, offered and accepted nodes by source."""
    rows = []
    for label in labels:
        mine = [r for r in recs if r["label"] == label and "counters" in r["method_config"].get("drafter", {})]
        if not mine:
            continue
        stages: dict = defaultdict(int)
        c: dict = defaultdict(int)
        for r in mine:
            d = r["method_config"]["drafter"]
            for k, v in d["stage_histogram"].items():
                stages[k] += v
            for k, v in d["counters"].items():
                c[k] += v
        d, steps = mine[0]["method_config"]["drafter"], max(sum(r["steps"] for r in mine), 1)
        hit = c["accepted_retrieval"] / c["offered_retrieval"] if c["offered_retrieval"] else float("nan")
        hist = ", ".join(f"{k}: {v / max(steps, 1):.2f}" for k, v in sorted(stages.items(), key=lambda kv: str(kv[0])))
        ctx_hit = c["accepted_context"] / c["offered_context"] if c["offered_context"] else float("nan")
        rows.append(f"| {label} | {d['variant']} / {d['policy']} | {hist} | {c['offered_draft'] / steps:.1f} / "
                    f"{c['offered_retrieval'] / steps:.1f} / {c['offered_context'] / steps:.1f} | "
                    f"{c['accepted_draft'] / steps:.2f} / {c['accepted_retrieval'] / steps:.2f} / "
                    f"{c['accepted_context'] / steps:.2f} | {hit:.3f} / {ctx_hit:.3f} | {c['dedup'] / steps:.1f} | "
                    f"{d['calibration'].split('/')[-1]} | {d['rows_filled']} ({d['populated_bytes'] / 1e6:.2f} MB) |")
    if not rows:
        return []
    return ["", "## Graft / pruning instrumentation (per step)", "",
            "Sources: draft (head or draft model) / matrix (adjacency-matrix retrieval) / context (continuations "
            "copied from earlier in the sequence). Stage `context`: the head was skipped for the context.", "",
            "| method | variant / gate | stage share | offered draft / matrix / context | accepted draft / matrix / "
            "context | hit rate matrix / context | dedup | calibration | matrix rows at end (populated) |",
            "|---|---|---|---|---|---|---|---|---|", *rows]


def markdown(rep: Report, command: str | None = None, reference: str | None = None,
             goals: list[str] | None = None) -> str:
    """The report; ``reference`` adds speedups vs that label, ``goals`` (``LABEL>REF:RATIO``) adds verdicts.
    Raises SpecgraftError on a bad goal or an unknown label."""
    recs = rep.records
    if not recs:
        return "no records\n"
    parsed = rs.check_labels(rep.labels, reference, [rs.parse_goal(g) for g in goals or []])
    pp = rs.per_prompt(recs)
    first = recs[0]
    lines = ["# specgraft benchmark report", ""]
    if command:
        lines += [f"Reproduce: `{command}`", ""]
    lines += [f"- model: {first['model']}, dtype: {first['dtype']}, max_new_tokens: {first['max_new_tokens']}, "
              f"sampling: {first['sampling']}",
              *rs.machine_lines(recs),
              *rs.commit_lines(recs),
              f"- retrieval state: {sorted({r['label'] + '=' + r['retrieval_state'] for r in recs if r['retrieval_state']})}",
              "- MAT includes the bonus token (AR = 1). Speedup: AR time per token / method time per token, on the "
              "same prompts in the same run (equal to the wall-time ratio when outputs are identical).",
              *_batched_lines(recs), ""]
    base = baseline(recs, rep.labels, reference)

    def table(group) -> list[str]:
        return _table(aggregate(recs, rep.labels, group, base), rep.labels, base)

    lines += ["## Overall", ""] + table(lambda r: "all")
    lines += rs.noise_lines(pp, rs.noise_pairs(recs, rep.labels))
    ar_label = baseline(recs, rep.labels)  # the run's AR, whatever --reference adds
    lines += rs.interval_table(pp, rep.labels, reference, _interval_groups(recs), ar_label)
    lines += rs.goal_lines(pp, parsed)
    lines += ["", "## Per dataset", ""] + table(lambda r: r["dataset"])
    lines += ["", "## Per category", ""] + table(lambda r: f"{r['dataset']}/{r['category']}")
    lines += rs.prompt_table(pp, rep.labels, ar_label)
    lines += _graft_table(recs, rep.labels)
    lines += rs.calibration_lines(recs, rep.labels)
    lines += ["", "## Exactness (greedy outputs vs the AR of the same backend and weights, by token ids)", ""]
    dtypes = {r["dtype"] for r in recs}
    refs = ar_references(recs, rep.labels)
    for label in rep.labels:
        if refs[label] == label:
            continue  # an AR reference itself
        if refs[label] is None:
            lines.append(f"- {label}: not checked (no AR ran on its backend and weights)")
            continue
        if not any(r["label"] == label and r["greedy"] and not r.get("lossy") for r in recs):
            lines.append(f"- {label}: not checked (sampled or lossy: token equality applies to greedy lossless "
                         "decoding; sampling is checked in distribution by the test suite)")
            continue
        mm = rep.mismatches.get(label, [])
        n = sum(1 for r in recs if r["label"] == label)
        verdict = "identical" if not mm else f"{len(mm)} of {n} differ (first divergence at tokens " \
                                             f"{sorted(i for _, i in mm)[:10]})"
        lines.append(f"- {label} vs {refs[label]}: {verdict}")
    if any(rep.mismatches.values()) and dtypes - {"float32", "fp32"}:
        lines.append("- Divergences in bf16/fp16/int4 are expected at near-ties of the target logits (a tree forward "
                     "and a one-token forward round differently), and on llama.cpp (`gguf`) at its quantised "
                     "kernels' batch-shape noise (docs/backends.md); exactness is established in fp32.")
    for p in rep.problems:
        lines.append(f"- FAIL: {p}")
    if rep.missing:
        lines += ["", "## Incomplete (a cut run: resume it to fill these; not a correctness failure)", ""]
        lines += [f"- {p}" for p in rep.missing]
    return "\n".join(lines) + "\n"


def _batched_lines(recs: list[dict]) -> list[str]:
    """How to read a batched run's times: each turn's are its own latency inside its group."""
    sizes = sorted({r["batch"]["size"] for r in recs if isinstance(r.get("batch"), dict)})
    if not sizes:
        return []
    return [f"- Batched groups of {'/'.join(map(str, sizes))} conversations: each turn's time is its latency in "
            "its group; its draft time is its own drafting, and other includes waiting for the group's other "
            "requests (their drafting, observing and prefills)."]


def plots(rep: Report, out_dir: str | Path, reference: str | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = baseline(rep.records, rep.labels, reference)
    overall = aggregate(rep.records, rep.labels, lambda r: "all", base)["all"]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4.5))
    pts = sorted((overall[label].mat, speedup(overall[base], overall[label]), label) for label in rep.labels)
    for mat, sp, label in pts:
        ax.scatter(mat, sp, s=40)
        ax.annotate(label, (mat, sp), fontsize=8, xytext=(4, 4), textcoords="offset points")
    # Pareto front: points no other point beats on both MAT and speedup.
    front = [(m, s) for m, s, _ in pts if not any(m2 >= m and s2 > s or m2 > m and s2 >= s for m2, s2, _ in pts)]
    ax.plot([m for m, _ in front], [s for _, s in front], color="tab:red", lw=1, alpha=0.6, label="Pareto front")
    ax.legend(fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("MAT (tokens per target forward, incl. bonus)")
    ax.set_ylabel("speedup vs AR (same run)")
    ax.set_title("Speedup vs MAT")
    paths.append(_save(plt, fig, out_dir / "speedup_vs_mat.png"))

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for label in rep.labels[1:]:
        alpha = overall[label].alpha
        if alpha:
            ax.plot(range(1, len(alpha) + 1), alpha, marker="o", label=label)
    ax.set_xlabel("tree depth d")
    ax.set_ylabel("P(accept at d | parent accepted)")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance by depth")
    ax.legend(fontsize=8)
    paths.append(_save(plt, fig, out_dir / "acceptance_by_depth.png"))

    cats = aggregate(rep.records, rep.labels, lambda r: f"{r['dataset']}/{r['category']}", base)
    names = sorted(cats)
    fig, ax = plt.subplots(figsize=(max(6, len(names) * 0.9), 4.5))
    width = 0.8 / max(1, len(rep.labels) - 1)
    for j, label in enumerate(rep.labels[1:]):
        vals = [speedup(cats[c][base], cats[c][label]) if base in cats[c] else 0 for c in names]
        ax.bar([i + j * width for i in range(len(names))], vals, width, label=label)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks([i + width * (len(rep.labels) - 2) / 2 for i in range(len(names))])
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup vs AR")
    ax.set_title("Speedup by category")
    ax.legend(fontsize=8)
    paths.append(_save(plt, fig, out_dir / "speedup_by_category.png"))
    return paths


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
