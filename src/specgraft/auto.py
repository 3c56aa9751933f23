"""``--method auto``: the fastest lossless method predicted for this model, dtype and machine.

    tokens/s(method, K) = MAT(K) / (draft_s + verify_s(K + 1))        AR: 1 / verify_s(1)

- ``verify_s``: the target's measured, cached verify-latency curve (``costs.latency_curve``).
- ``MAT(K)``: replayed from the shipped calibration's accepted score ranks (``choose_budget``).
- ``draft_s``: the calibration's mean drafting time per step; for Graft scaled by the share of drafting passes
  its calibrated gate lets run (the gate stops the drafter early on most steps).

A speculative method is chosen only when it is predicted at least ``MARGIN`` faster than AR. The choice is
cached next to the latency curve (per model, dtype, machine and torch build) and recomputed when the curve or
a calibration file changes. In our words: docs/design.md §5.9.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .costs import (curve_path, engine_key, file_stamp, interpolate, latency_curve,  # noqa: F401 -- machine_key
                    machine_key, write_json)  # re-exported
from .errors import SpecgraftError
from .graft.calibration import Calibration, below, expected_mat, gate_pass_share  # noqa: F401 -- below re-exported
from .models import REGISTRY, cache_root, package_file
from .registry import DEFAULTS, calibration_dir, find_calibration, shipped_head

MARGIN = 1.05  # a speculative method must be predicted this much faster than AR
VERSION = 1  # bump when the prediction changes: cached choices of older versions are recomputed


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


def decide(model_name: str, curve: dict[int, float], found: list[tuple[Candidate, Calibration]]) -> AutoChoice:
    """Pure decision from a latency curve and loaded calibrations (the tests drive it with fake curves)."""
    ar_tps = 1.0 / interpolate(curve, 1)
    table = [{"method": "ar", "options": {}, "budget": 0, "mat": 1.0, "draft_s": 0.0,
              "verify_s": round(1.0 / ar_tps, 5), "tokens_per_s": round(ar_tps, 3), "vs_ar": 1.0}]
    for c, cal in found:
        if not cal.accepted_ranks:
            continue  # a calibration without acceptance data predicts nothing
        row = predict(c, cal, curve)
        row["vs_ar"] = round(row["tokens_per_s"] / ar_tps, 3)
        table.append(row)
    spec = sorted(table[1:], key=lambda r: -r["tokens_per_s"])
    if not spec:
        return AutoChoice("ar", 0, {}, f"AR: no calibrated speculative method ships for model '{model_name}' "
                          "(calibrate one with `specgraft calibrate`)", table)
    best = spec[0]
    label = best["method"] + "".join(f" {k}={v}" for k, v in best["options"].items())
    if best["tokens_per_s"] < MARGIN * ar_tps:
        return AutoChoice("ar", 0, {}, f"AR: no speculative method is predicted to beat it on this machine by "
                          f"{MARGIN - 1:.0%} (best: {label} budget {best['budget']}, predicted "
                          f"{best['vs_ar']:.2f}x of AR's {ar_tps:.1f} tok/s)", table)
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
    if not found:  # nothing to predict from: no measurement needed
        return decide(engine.model_name, {1: 1.0}, [])
    path = _cache_path(engine)
    fp = _fingerprint(engine, [p for _, p in found])
    if path.exists():
        try:
            body = json.loads(path.read_text())
            if body.get("fingerprint") == fp:
                return AutoChoice(**body["choice"])
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache file is recomputed
    curve = latency_curve(engine)
    choice = decide(engine.model_name, curve, [(c, Calibration.load(p)) for c, p in found])
    write_json(path, {"fingerprint": _fingerprint(engine, [p for _, p in found]), "choice": choice.to_dict()})
    return choice


def resolve(engine, method: str) -> tuple[str, int | None, dict, AutoChoice | None]:
    """``"auto"`` -> the chosen ``(method, budget, options, choice)``; any other method passes through as
    ``(method, None, {}, None)`` (budget None = the method's default)."""
    if method != "auto":
        return method, None, {}, None
    choice = choose_method(engine)
    return choice.method, choice.budget, dict(choice.options), choice


__all__ = ["AutoChoice", "MARGIN", "auto_budget", "choose_budget", "choose_method", "decide", "resolve"]
