"""``--budget auto``: the node budget that maximises expected tokens per second on *this* machine.

    tokens/s(K) = MAT(K) / (draft_s + verify_s(K + 1))

- ``verify_s(W)``: the target's latency for one forward over ``W`` tree slots, measured once per model,
  dtype, machine and torch build (a chain of ``W`` tokens after a 256-token prefix, median of 3), cached.
- ``MAT(K)``: replayed exactly from calibration: a dense dynamic tree at budget ``K`` is the top-``K``
  candidates by score, and along the accepted path scores fall, so under greedy verification the path
  accepted at budget ``K`` is the accepted nodes whose score rank is below ``K`` (ranks recorded per step).
- ``draft_s``: the mean drafting time per step measured during calibration.

In our words, with the worked examples the tests assert: docs/design.md §5.8.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from pathlib import Path

from ..core.tree import Tree
from ..env import cpu_name
from ..errors import SpecgraftError
from ..models import cache_root
from ..registry import DEFAULTS, calibration_dir
from .calibration import Calibration, expected_mat

WIDTHS = (1, 2, 4, 8, 12, 16, 20, 24, 32, 40, 48, 61, 64)


def machine_key(model: str, dtype: str, device: str = "cpu") -> str:
    """Where a measured curve is valid: model, dtype (gguf: the llama.cpp backend), device, machine, torch."""
    cpu = cpu_name()
    raw = f"{model}|{dtype}|{cpu}|threads={torch.get_num_threads()}|torch={torch.__version__}"
    if device != "cpu":  # CPU keys keep their old form (existing caches stay valid)
        raw += f"|device={device}"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in raw)[:200]


def engine_key(engine) -> str:
    return machine_key(engine.model_name, engine.dtype, getattr(engine, "device", "cpu"))


def latency_curve(engine, widths=WIDTHS, prefix: int = 256, reps: int = 3, refresh: bool = False) -> dict[int, float]:
    """Seconds per verification forward by slot count (cached per model, dtype, machine and torch)."""
    path = cache_root() / "latency" / f"{engine_key(engine)}.json"
    if path.exists() and not refresh:
        return {int(k): v for k, v in json.loads(path.read_text())["seconds"].items()}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, min(engine.vocab_size, 20000), (prefix + max(widths),), generator=gen)
    backend = engine.backend
    if backend.rows:
        raise SpecgraftError("the latency curve is measured on an idle engine (requests are in flight)")
    backend.prefill(ids[:prefix])
    out: dict[int, float] = {}
    for w in (widths[0], *widths):  # the first width twice: warm-up
        times = []
        for _ in range(reps):
            tree = Tree.chain(int(ids[prefix]), ids[prefix + 1: prefix + w].tolist())
            t0 = time.perf_counter()
            backend.verify(tree)
            times.append(time.perf_counter() - t0)
            backend.truncate(prefix)
        out[w] = statistics.median(times)
    backend.reset()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": engine_key(engine), "prefix": prefix,
                                "seconds": out}, indent=1))
    return out


def interpolate(curve: dict[int, float], w: int) -> float:
    xs = sorted(curve)
    if w <= xs[0]:
        return curve[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if w <= b:
            return curve[a] + (curve[b] - curve[a]) * (w - a) / (b - a)
    a, b = xs[-2], xs[-1]  # extrapolate linearly beyond the last measurement
    return curve[b] + (curve[b] - curve[a]) * (w - b) / (b - a)


def choose_budget(curve: dict[int, float], accepted_ranks: list[list[int]], draft_s: float,
                  max_budget: int) -> tuple[int, list[dict]]:
    """The budget in ``1..max_budget`` with the highest expected tokens/s, and the whole table."""
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
    """Resolve ``--budget auto`` for eagle / graft / prune from the calibration of their drafter."""
    if method not in ("eagle", "graft", "prune"):
        raise SpecgraftError(f"--budget auto needs a tree method with a calibration (eagle, graft, prune), not "
                             f"'{method}'")
    opts = {**DEFAULTS[method], **options}
    opts.setdefault("drafter", "eagle")
    if opts["drafter"] == "draft-chain":
        raise SpecgraftError("--budget auto covers tree drafters; chains use tau_tail")
    where = opts.get("calibration", "auto")
    path = calibration_dir(opts, engine.model_name) if where in ("auto", None) else where
    cal = Calibration.load(Path(path))
    curve = latency_curve(engine)
    max_budget = int(cal.meta.get("budget", 60))
    best, table = choose_budget(curve, cal.accepted_ranks, float(cal.meta.get("draft_s_per_step", 0.0)), max_budget)
    return best, {"chosen": best, "calibration": str(path), "max_budget": max_budget,
                  "predicted": next(r for r in table if r["budget"] == best)}
