"""``--backend auto``: the backend and weight format predicted fastest for this model on this machine.

The candidates all run the user's model file:

    llamacpp / gguf          the GGUF itself on llama.cpp (needs specgraft[llamacpp]; a registry model or a .gguf)
    transformers / int4      the GGUF's own 4-bit codes through PyTorch's int4 kernel (registry models, CPU)
    transformers / --dtype   the dequantised model in the requested dtype (registry models, HF directories);
                             with --dtype auto on a CPU without packed bf16, both fp32 and bf16

Each is scored by the tokens/s of its best lossless method, predicted by ``--method auto``'s model
(``auto.decide``: the backend's measured cost curve, cached per machine, and the shipped calibrations), and the
fastest wins. The prediction is for one request at a time. A missing curve is measured once, each candidate loaded
in turn (the fastest so far stays open, so the winner is not loaded twice; the others are freed); the decision is
cached next to the curves and recomputed when a curve or calibration changes.
Lossless holds on whichever wins: its output equals AR of the weights it runs (docs/backends.md).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .auto import candidates, decide
from .backends import INT4, open_backend
from .core.backend import torch_runtime
from .costs import backend_curve, backend_curve_path, file_stamp, machine_key, write_json
from .errors import SpecgraftError
from .graft.calibration import Calibration
from .models import AUTO_DTYPE, REGISTRY, cache_root, resolve_dtype

AUTO = "auto"
VERSION = 1  # bump when the scoring changes: cached decisions of older versions are recomputed


@dataclass(frozen=True)
class Option:
    backend: str  # an ``open_backend`` kind
    dtype: str  # what ``open_backend`` takes (llama.cpp ignores it: it runs the GGUF's own types)


@dataclass
class BackendChoice:
    backend: str
    dtype: str
    weights: str  # the winner's ``Capabilities.weights``
    reason: str
    table: list[dict] = field(default_factory=list)  # one row per candidate, fastest first

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return f"{self.backend} ({self.weights})"


def options(model: str, dtype: str, device: str, llama_cpp_installed: bool | None = None) -> list[Option]:
    """The (backend, weights) pairs that can run ``model`` here."""
    if llama_cpp_installed is None:
        llama_cpp_installed = importlib.util.find_spec("llama_cpp") is not None
    gguf_file = model.endswith(".gguf")
    out = []
    if device == "cpu" and llama_cpp_installed and (model in REGISTRY or gguf_file):
        out.append(Option("llamacpp", dtype))
    if device == "cpu" and model in REGISTRY:
        out.append(Option("transformers", INT4))
    if not gguf_file and dtype != INT4:
        out += [Option("transformers", d) for d in transformers_dtypes(dtype, device)]
    if not out:
        raise SpecgraftError(f"--backend auto: no backend can run '{model}' with --dtype {dtype} on {device}")
    return out


def transformers_dtypes(dtype: str, device: str) -> list[str]:
    """The dense dtypes to score: ``--dtype auto`` on a CPU without a packed bf16 path scores both fp32 (cheaper
    from 3-4 tokens a forward there) and emulated bf16 (cheaper at 1-2: half the bytes), since which one wins
    depends on the method's widths (docs/backends.md, "--dtype auto"); otherwise the one dtype it resolves to."""
    if dtype == AUTO_DTYPE and device == "cpu" and resolve_dtype(dtype, device) == "float32":
        return ["float32", "bfloat16"]
    return [resolve_dtype(dtype, device)]


def score(model: str, backend) -> dict:
    """One candidate's row: its curve's AR speed and its best lossless method's predicted speed."""
    caps = backend.capabilities
    curve = backend_curve(model, backend)
    found = [(c, Calibration.load(p)) for c, p in candidates(model, caps.hidden_states)]
    choice = decide(model, curve, found)
    rows = [r for r in choice.table if r["method"] == choice.method and r["options"] == choice.options]
    row = rows[0] if choice.method != "ar" else choice.table[0]
    return {"backend": caps.name, "label": caps.shown, "weights": caps.weights, "method": choice.method,
            "options": dict(choice.options), "budget": choice.budget, "tokens_per_s": row["tokens_per_s"],
            "ar_tokens_per_s": choice.table[0]["tokens_per_s"], "curve": str(backend_curve_path(model, caps))}


def pick(rows: list[dict]) -> tuple[dict, str]:
    """The fastest row and why (pure: the tests drive it with made-up rows)."""
    ranked = sorted(rows, key=lambda r: -r["tokens_per_s"])
    best = ranked[0]

    def said(r: dict) -> str:
        opts = "".join(f" {k}={v}" for k, v in r["options"].items())
        how = "AR" if r["method"] == "ar" else f"{r['method']}{opts} budget {r['budget']}"
        return f"{r['label']} {r['weights']}: {r['tokens_per_s']:.1f} tok/s ({how})"

    others = "; ".join(said(r) for r in ranked[1:]) or "no other backend can run this model here"
    return best, (f"predicted {said(best)}; {others}. From this machine's measured cost curves and the shipped "
                  "calibrations, for one request at a time")


def _decision_path(model: str, dtype: str, device: str) -> Path:
    llama = "none"
    if importlib.util.find_spec("llama_cpp") is not None:
        import importlib.metadata as md

        llama = md.version("llama_cpp_python")
    key = machine_key(model, f"auto-{dtype}", device, f"{torch_runtime()}|llama_cpp={llama}")
    return cache_root() / "latency" / f"{key}.backend.json"


def _fingerprint(rows: list[dict], model: str) -> dict:
    """What a decision depends on: the candidates' curve files and every calibration they could be scored with."""
    cals = [p / "calibration.json" for _, p in candidates(model, hidden_states=True)]
    return {"version": VERSION, "curves": {r["curve"]: file_stamp(Path(r["curve"])) for r in rows},
            "calibrations": {str(p): file_stamp(p) for p in cals}}


def _cached(path: Path, model: str, opts: list[Option]) -> BackendChoice | None:
    try:
        body = json.loads(path.read_text())
        choice = BackendChoice(**body["choice"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or damaged: recomputed
    if body.get("options") != [asdict(o) for o in opts]:
        return None
    if body.get("fingerprint") != _fingerprint(choice.table, model):
        return None
    return choice


def _progress(message: str) -> None:
    print(f"specgraft: {message}", file=sys.stderr, flush=True)


def choose_backend(model: str, dtype: str, cache_dir=None, device: str = "cpu", log=_progress):
    """``(BackendChoice, (backend, tokenizer))``: the winner, opened. Candidates that fail to open are left out
    (said in the reason); if none opens, the first error is raised."""
    opts = options(model, dtype, device)
    path = _decision_path(model, dtype, device)
    choice = _cached(path, model, opts)
    if choice is not None:
        return choice, open_backend(choice.backend, model, choice.dtype, cache_dir, device)
    rows, errors, fastest = [], [], None  # fastest: (tokens/s, option, opened), kept open so it is not loaded twice
    for opt in opts:
        opened = None
        gc.collect()  # a slower candidate's weights go before the next one loads
        try:
            if log:
                weights = opt.dtype if opt.backend == "transformers" else "gguf"
                log(f"--backend auto: scoring {opt.backend} ({weights}); a missing cost curve is measured once")
            opened = open_backend(opt.backend, model, opt.dtype, cache_dir, device)
        except SpecgraftError as err:
            errors.append((opt, err))
            continue
        rows.append({**score(model, opened[0]), "dtype": opt.dtype})
        if fastest is None or rows[-1]["tokens_per_s"] > fastest[0]:
            fastest = (rows[-1]["tokens_per_s"], opt, opened)
    if not rows:
        raise errors[0][1]
    best, reason = pick(rows)
    reason += "".join(f"; {o.backend} ({o.dtype}) left out: {err}" for o, err in errors)
    winner = fastest[1]
    assert (winner.backend, winner.dtype) == (best["backend"], best["dtype"])  # pick and the scan agree on ties
    choice = BackendChoice(winner.backend, winner.dtype, best["weights"], reason,
                           sorted(rows, key=lambda r: -r["tokens_per_s"]))
    if all(Path(r["curve"]).exists() for r in choice.table):  # an uncached (contended) curve: decide again next run
        write_json(path, {"options": [asdict(o) for o in opts], "fingerprint": _fingerprint(choice.table, model),
                          "choice": choice.to_dict()})
    return choice, fastest[2]
