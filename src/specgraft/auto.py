"""``--method auto``: the fastest lossless method predicted for this model, dtype and machine.

    tokens/s(method, K) = MAT(K) / (draft_s + verify_s(K + 1))        AR: 1 / verify_s(1)

- ``verify_s``: the target's measured, cached verify-latency curve (``costs.latency_curve``).
- ``MAT(K)``: replayed from the shipped calibration's accepted score ranks (``choose_budget``).
- ``draft_s``: the calibration's mean drafting time per step; for Graft scaled by the share of drafting passes
  its calibrated gate lets run (the gate stops the drafter early on most steps).

Cost-sized prompt lookup (``pld length=cost``) is predicted by replaying it exactly on the calibration's stored
greedy decodes (``graft.lookup.replay``): the warm-up decodes (general chat, comparable with the trees') and the
decodes added for the context table (``calibrate --context-only --data``: copying). It drafts only where a draft
pays, so where no tree beats AR it replaces AR when its replay is not slower than AR on general chat and at least
``MARGIN`` faster on copying (``decide``).

A speculative method is chosen only when it is predicted at least ``MARGIN`` faster than AR. The choice is
cached next to the latency curve (per model, dtype, machine and torch build) and recomputed when the curve or
a calibration file changes. In our words: docs/design.md §5.9.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .costs import (curve_cost, curve_path, engine_key, file_stamp, interpolate,  # noqa: F401 -- machine_key
                    latency_curve, machine_key, write_json)  # re-exported
from .errors import SpecgraftError
from .graft.calibration import Calibration, below, expected_mat, gate_pass_share  # noqa: F401 -- below re-exported
from .graft.context import ContextModel
from .graft.lookup import CostSizedLookup, replay
from .models import REGISTRY, cache_root, package_file
from .registry import DEFAULTS, calibration_dir, context_calibration, find_calibration, shipped_head

MARGIN = 1.05  # a speculative method must be predicted this much faster than AR
VERSION = 2  # bump when the prediction changes: cached choices of older versions are recomputed
LOOKUP_BUDGETS = (4, 8, 16, 32, 64)  # cost-sized PLD's caps tried in the replay


@dataclass
class AutoChoice:
    method: str
    budget: int | None
    options: dict
    reason: str
    table: list[dict] = field(default_factory=list)  # every candidate's prediction, AR first

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """``graft drafter=draft-tree (budget 31)``: what the CLI and server print."""
        opts = "".join(f" {k}={v}" for k, v in self.options.items())
        return f"{self.method}{opts} (budget {self.budget})"


@dataclass(frozen=True)
class Candidate:
    method: str
    options: dict
    drafter: str  # the calibration's drafter: eagle or draft-tree


def candidates(model_name: str, hidden_states: bool = True) -> list[tuple[Candidate, Path]]:
    """The tree methods that can run on this model and backend and have a calibration to predict them from
    (EAGLE heads need a backend that declares hidden states)."""
    head = shipped_head(model_name) is not None and hidden_states
    out = [(Candidate("graft", {}, "eagle"), head), (Candidate("eagle", {}, "eagle"), head),
           (Candidate("graft", {"drafter": "draft-tree"}, "draft-tree"), None)]
    found = []
    for c, runnable in out:
        path = calibration_dir({"drafter": c.drafter, "head": "auto"}, model_name)
        if not (path / "calibration.json").exists():
            continue
        if runnable is None:  # the draft-model tree needs its draft model installed
            runnable = _installed(DEFAULTS["graft"]["model"])
        if runnable:
            found.append((c, path))
    return found


def _installed(model: str) -> bool:
    """Is a registry draft model available without downloading anything (converted copy or its packages)?"""
    spec = REGISTRY.get(model)
    if spec is None:
        return False
    if (cache_root() / "models" / model / "config.json").exists():
        return True
    try:
        return all(package_file(req.split("==")[0], spec.suffix) is not None for req in spec.packages)
    except SpecgraftError:
        return False


def draft_share(method: str, drafter: str, cal: Calibration) -> float:
    """The share of the calibrated drafting time a method pays per step: Graft's gate stops the drafter early on
    most steps; EAGLE and the pruning baselines draft in full. (The server's budget policy uses it too.)"""
    if method != "graft":
        return 1.0
    return gate_pass_share(cal, DEFAULTS["eagle" if drafter == "eagle" else "draft"]["depth"])


def choose_budget(curve: dict[int, float], accepted_ranks: list[list[int]], draft_s: float,
                  max_budget: int) -> tuple[int, list[dict]]:
    """The budget in ``1..max_budget`` with the highest expected tokens/s, and the whole table.

        tokens/s(K) = MAT(K) / (draft_s + verify_s(K + 1))

    ``MAT(K)`` is replayed exactly from calibration: a dense dynamic tree at budget ``K`` is the top-``K``
    candidates by score, and along the accepted path scores fall, so under greedy verification the path
    accepted at budget ``K`` is the accepted nodes whose score rank is below ``K`` (docs/design.md §5.8)."""
    if not accepted_ranks:
        raise SpecgraftError("--budget auto needs acceptance data: run `specgraft calibrate` first")
    table = []
    for k in range(1, max_budget + 1):
        mat = expected_mat(accepted_ranks, k)
        step = draft_s + interpolate(curve, k + 1)
        table.append({"budget": k, "mat": round(mat, 4), "step_s": round(step, 4), "tokens_per_s": mat / step})
    best = max(table, key=lambda r: r["tokens_per_s"])
    return best["budget"], table


def auto_budget(engine, method: str, options: dict) -> tuple[int, dict]:
    """``--budget auto`` for eagle / graft / prune: the best budget from this machine's curve and the
    calibration of their drafter."""
    if method not in ("eagle", "graft", "prune"):
        raise SpecgraftError(f"--budget auto needs a tree method with a calibration (eagle, graft, prune), not "
                             f"'{method}'")
    opts = {**DEFAULTS[method], **options}
    opts.setdefault("drafter", "eagle")
    if opts["drafter"] == "draft-chain":
        raise SpecgraftError("--budget auto covers tree drafters; chains use tau_tail")
    cal, where = find_calibration(opts, engine.model_name, required=True)
    best, table = choose_budget(latency_curve(engine), cal.accepted_ranks, cal.draft_s, cal.max_budget)
    return best, {"chosen": best, "calibration": where, "max_budget": cal.max_budget,
                  "predicted": next(r for r in table if r["budget"] == best)}


def predict(c: Candidate, cal: Calibration, curve: dict[int, float]) -> dict:
    """The candidate's best budget and its predicted MAT, step time and tokens/s."""
    draft_s = cal.draft_s
    share = draft_share(c.method, c.drafter, cal)
    budget, table = choose_budget(curve, cal.accepted_ranks, draft_s * share, cal.max_budget)
    row = next(r for r in table if r["budget"] == budget)
    return {"method": c.method, "options": dict(c.options), "budget": budget, "mat": row["mat"],
            "draft_s": round(draft_s * share, 5), "verify_s": round(row["step_s"] - draft_s * share, 5),
            "tokens_per_s": round(row["tokens_per_s"], 3), "draft_pass_share": round(share, 3),
            "calibration_dtype": cal.meta.get("dtype")}


def predict_lookup(curve: dict[int, float], cal: Calibration, where: str = "calibration") -> dict | None:
    """Cost-sized PLD replayed on ``cal``'s stored decodes at each of ``LOOKUP_BUDGETS``, on the general (warm-up)
    and the copying (added) decodes. The cap: the fastest on copying among those not slower than AR on general
    chat, else the fastest on general chat. The row's ``tokens_per_s`` is the general prediction (comparable
    with the trees'). None without both kinds of decodes (nothing would show what it gains, or costs, there).
    In-sample: the context table was fitted on these decodes, so the prediction leans optimistic (as the trees'
    replays of their own calibration do)."""
    # the first output token comes from the prefill: the first step drafts on prompt + that token
    general = [(s[1:], s[0] + 1) for s in cal.sequences]
    copying = [(s[1:], s[0] + 1) for src in cal.context_sources for s in src.get("sequences", [])]
    if not general or not copying:
        return None
    cost, model, opts = curve_cost(curve), ContextModel.from_fit(cal.context, where), DEFAULTS["pld"]
    ar_tps = 1.0 / cost(1)

    def run(seqs, budget: int) -> dict:
        r = replay(CostSizedLookup(cost, model, opts["max_ngram"], opts["chains"]), seqs, budget)
        return {**r, "vs_ar": r["tokens"] / (r["verify_s"] + r["host_s"]) / ar_tps}

    runs = {b: (run(general, b), run(copying, b)) for b in LOOKUP_BUDGETS}
    safe = [b for b in LOOKUP_BUDGETS if round(runs[b][0]["vs_ar"], 3) >= 1.0]  # the number ``decide`` reads
    budget = (max(safe, key=lambda b: runs[b][1]["vs_ar"]) if safe
              else max(LOOKUP_BUDGETS, key=lambda b: runs[b][0]["vs_ar"]))
    gen, cop = runs[budget]
    return {"method": "pld", "options": {"length": "cost"}, "budget": budget,
            "mat": round(gen["tokens"] / gen["steps"], 4), "draft_s": round(gen["host_s"] / gen["steps"], 5),
            "verify_s": round(gen["verify_s"] / gen["steps"], 5), "tokens_per_s": round(gen["vs_ar"] * ar_tps, 3),
            "mat_copying": round(cop["tokens"] / cop["steps"], 4), "vs_ar_copying": round(cop["vs_ar"], 3),
            "by_budget": {str(b): {"general": round(g["vs_ar"], 3), "copying": round(c["vs_ar"], 3)}
                          for b, (g, c) in runs.items()},
            "decodes": {"general": len(general), "copying": len(copying)}}


def decide(model_name: str, curve: dict[int, float], found: list[tuple[Candidate, Calibration]],
           lookup: dict | None = None) -> AutoChoice:
    """Pure decision from a latency curve, loaded calibrations and cost-sized PLD's replay row
    (``predict_lookup``; the tests drive it with fake curves)."""
    ar_tps = 1.0 / interpolate(curve, 1)
    table = [{"method": "ar", "options": {}, "budget": 0, "mat": 1.0, "draft_s": 0.0,
              "verify_s": round(1.0 / ar_tps, 5), "tokens_per_s": round(ar_tps, 3), "vs_ar": 1.0}]
    for c, cal in found:
        if not cal.accepted_ranks:
            continue  # a calibration without acceptance data predicts nothing
        row = predict(c, cal, curve)
        row["vs_ar"] = round(row["tokens_per_s"] / ar_tps, 3)
        table.append(row)
    if lookup is not None:
        table.append({**lookup, "vs_ar": round(lookup["tokens_per_s"] / ar_tps, 3)})
    spec = sorted(table[1:], key=lambda r: -r["tokens_per_s"])
    if not spec:
        return AutoChoice("ar", 0, {}, f"AR: no calibrated speculative method ships for model '{model_name}' "
                          "(calibrate one with `specgraft calibrate`)", table)
    best = spec[0]
    label = best["method"] + "".join(f" {k}={v}" for k, v in best["options"].items())
    if best["tokens_per_s"] < MARGIN * ar_tps:
        why = (f"no speculative method is predicted to beat it on this machine by {MARGIN - 1:.0%} (best: {label} "
               f"budget {best['budget']}, predicted {best['vs_ar']:.2f}x of AR's {ar_tps:.1f} tok/s)")
        row = table[-1] if lookup is not None else None
        if row is not None and row["vs_ar"] >= 1.0 and row["vs_ar_copying"] >= MARGIN:
            return AutoChoice("pld", row["budget"], dict(row["options"]),
                              f"pld length=cost instead of AR: {why}; it drafts only where a draft pays, predicted "
                              f"{row['vs_ar']:.2f}x AR on general chat and {row['vs_ar_copying']:.2f}x where text "
                              f"repeats (MAT {row['mat_copying']:.2f}; replayed on the calibration's "
                              f"{row['decodes']['general']} + {row['decodes']['copying']} stored decodes)", table)
        if row is not None:
            why += (f"; pld length=cost replays at {row['vs_ar']:.3f}x AR on general chat and "
                    f"{row['vs_ar_copying']:.2f}x on copying (budget {row['budget']}): it is chosen over AR only "
                    f"when not slower on the first and {MARGIN - 1:.0%} faster on the second")
        return AutoChoice("ar", 0, {}, f"AR: {why}", table)
    return AutoChoice(best["method"], best["budget"], dict(best["options"]),
                      f"predicted {best['tokens_per_s']:.1f} tok/s vs AR {ar_tps:.1f} ({best['vs_ar']:.2f}x; "
                      f"MAT {best['mat']:.2f}, {1000 * (best['draft_s'] + best['verify_s']):.0f} ms per step) "
                      "from this machine's verify latency and the shipped calibration", table)


def _cache_path(engine) -> Path:
    return cache_root() / "latency" / f"{engine_key(engine)}.auto.json"


def _fingerprint(engine, paths: list[Path]) -> dict:
    """What a cached choice depends on: the curve file and the calibrations (size, mtime)."""
    curve = curve_path(engine)
    return {"version": VERSION, "curve": file_stamp(curve),
            "calibrations": {str(p): file_stamp(p / "calibration.json") for p in paths}}


def choose_method(engine) -> AutoChoice:
    """The method (and budget, options) ``--method auto`` runs on ``engine``; cached per model and dtype."""
    found = candidates(engine.model_name, engine.capabilities.hidden_states)
    context_cal, context_where = context_calibration(engine.model_name)
    if context_cal is not None and not context_cal.context_sources:
        context_cal = None  # no copying decodes: cost-sized PLD is not predicted
    if not found and context_cal is None:  # nothing to predict from: no measurement needed
        return decide(engine.model_name, {1: 1.0}, [])
    paths = [p for _, p in found] + ([Path(context_where)] if context_cal is not None else [])
    path = _cache_path(engine)
    fp = _fingerprint(engine, paths)
    if path.exists():
        try:
            body = json.loads(path.read_text())
            if body.get("fingerprint") == fp:
                return AutoChoice(**body["choice"])
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache file is recomputed
    curve = latency_curve(engine)
    lookup = predict_lookup(curve, context_cal, context_where) if context_cal is not None else None
    choice = decide(engine.model_name, curve, [(c, Calibration.load(p)) for c, p in found], lookup)
    if curve_path(engine).exists():  # a curve left uncached (measured under contention) leaves this uncached too
        write_json(path, {"fingerprint": _fingerprint(engine, paths), "choice": choice.to_dict()})
    return choice


def resolve(engine, method: str) -> tuple[str, int | None, dict, AutoChoice | None]:
    """``"auto"`` -> the chosen ``(method, budget, options, choice)``; any other method passes through as
    ``(method, None, {}, None)`` (budget None = the method's default)."""
    if method != "auto":
        return method, None, {}, None
    choice = choose_method(engine)
    return choice.method, choice.budget, dict(choice.options), choice


__all__ = ["AutoChoice", "MARGIN", "auto_budget", "choose_budget", "choose_method", "decide", "predict_lookup",
           "resolve"]
