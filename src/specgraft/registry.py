"""Drafter registry: method name -> constructor, with each method's defaults in one place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .backends.packed import prepack
from .core.backend import Backend, TargetBackend
from .core.drafter import Drafter, NoDraft
from .core.sampling import TRUNCATION_KEYS, SamplingParams
from .costs import backend_curve, backend_key, curve_cost
from .drafters.draft_model import DraftModelDrafter
from .drafters.pld import PromptLookup
from .drafters.recycling import TokenRecycling
from .eagle.checkpoint import load_head
from .eagle.drafter import EagleDrafter
from .eagle.head import Eagle3Head
from .errors import SpecgraftError
from .graft.calibration import Calibration
from .graft.context import ContextModel
from .graft.drafter import GraftDrafter
from .graft.lookup import CostSizedLookup
from .graft.pruning import make_policy
from .lossy.rules import Rule
from .models import cache_root, load

# Per-method defaults, printed by `specgraft generate --help` and written into every record.
DEFAULTS: dict[str, dict] = {
    "ar": {"budget": 0},
    # length: "budget" drafts the budget's worth on every match; "cost" drafts, per step, the length that maximises
    # expected tokens per second on this machine's measured cost curve (0 when nothing pays), up to the budget,
    # from up to ``chains`` distinct continuations (graft/lookup.py).
    "pld": {"budget": 10, "max_ngram": 3, "length": "budget", "chains": 4},
    "recycle": {"budget": 80, "k": 8, "scope": "cold"},
    "draft": {"budget": 4, "model": "qwen2.5-coder-0.5b", "shape": "chain", "top_k": 8, "depth": 5},
    # EAGLE-3: 60 verified tokens incl. the root, depth 7 (depth 5 is EAGLE-2's and under-drafts, EAGLE#209).
    "eagle": {"budget": 59, "head": "auto", "top_k": 10, "depth": 7},
    # Graft (lossless): prune at calibrated checkpoints, fill freed slots from the matrix. drafter: eagle,
    # draft-tree or draft-chain; variant: graft | fixed | root | batch (trees), tail (chains); "auto" top_k /
    # depth = the inner drafter's defaults; calibration: "auto" (beside the head), "none" or a directory.
    # context: on = prompt-lookup continuations compete with the matrix for the freed slots; off = the paper's.
    "graft": {"budget": 59, "drafter": "eagle", "variant": "graft", "head": "auto", "model": "qwen2.5-coder-0.5b",
              "top_k": "auto", "depth": "auto", "k": 8, "scope": "request", "dedup": "merge",
              "calibration": "auto", "rho": "auto", "matrix": "auto", "tpl_depth": "auto", "tpl_width": "auto",
              "context": "on", "ctx_ngram": 3, "ctx_chains": 4},
    # Pruning only (no retrieval): echo (Graft's calibrated gate), ddd, svip; param overrides ddd/svip's level.
    "prune": {"budget": 59, "drafter": "eagle", "policy": "echo", "param": "auto", "head": "auto",
              "model": "qwen2.5-coder-0.5b", "top_k": "auto", "depth": "auto", "calibration": "auto", "rho": "auto"},
    # Outside reference, not a drafter: transformers' assisted generation with a draft model (reference.py).
    "hf_assisted": {"budget": 0, "model": "qwen2.5-coder-0.5b"},
    # Outside reference on --backend llamacpp: llama-cpp-python's own prompt lookup (its defaults).
    "llama_pld": {"budget": 0, "max_ngram_size": 2, "num_pred_tokens": 10},
    # Outside reference on --backend llamacpp: llama.cpp's own server and speculation (llama_server.py).
    "llama_server": {"budget": 0, "spec": "none", "draft_model": "", "args": ""},
}
REFERENCES = {"hf_assisted": "transformers", "llama_pld": "llamacpp", "llama_server": "llamacpp"}  # run this backend's library loop, not ours
METHODS = tuple(DEFAULTS)


def method_options(method: str, options: dict) -> dict:
    """The options a request of ``method`` runs with: the method's defaults (budget aside: it is sized
    separately) overridden by the request's own."""
    return {**{k: v for k, v in DEFAULTS.get(method, {}).items() if k != "budget"}, **options}
# Per-request keys a benchmark method entry may carry besides the method's options: the verification rule,
# the truncation-sampling settings the rule is compared against, and a label for repeated configurations.
LOOP_KEYS = ("verify", *TRUNCATION_KEYS, "label")


def check_options(method: str, options, extra: tuple[str, ...] = ()) -> None:
    """One error for an unknown method or option (``extra``: per-request keys a caller also accepts)."""
    if method not in DEFAULTS:
        raise SpecgraftError(f"unknown method '{method}'; choose one of: {', '.join(METHODS)}")
    unknown = set(options) - set(DEFAULTS[method]) - set(extra)
    if unknown:
        raise SpecgraftError(f"method '{method}' has no option(s) {sorted(unknown)}; it takes {sorted(DEFAULTS[method])}")


@dataclass(frozen=True)
class Target:
    """What a drafter may bind to: the target's backend (its declared capabilities, its draft-model factory) and
    its registry name. Without a backend (tests, tools on a bare HF model) ``model`` is the HF module EAGLE
    heads read and draft models must be passed loaded."""

    vocab_size: int
    name: str = "custom"
    backend: Backend | None = None
    model: object = None

    @property
    def hidden_states(self) -> bool:
        return self.backend.capabilities.hidden_states if self.backend is not None else self.model is not None

    @property
    def head_target(self):
        return self.backend.model if self.backend is not None else self.model


def make_drafter(method: str, vocab_size: int, dtype: str = "float32", target=None, target_name: str = "custom",
                 device: str = "cpu", backend: Backend | None = None, **options) -> Drafter:
    """Build a drafter; ``options`` override ``DEFAULTS[method]`` (``budget`` is the loop's, not the drafter's).

    ``backend`` (the engine's target backend) is what drafters bound to the target read: its capabilities
    (hidden states for EAGLE heads), its model, its draft-model factory. Without it, ``target`` is the HF model
    a head binds to and a draft model is loaded with transformers at ``dtype`` on ``device``.
    """
    check_options(method, options)
    opts = {**DEFAULTS[method], **options}  # "budget" belongs to the loop; drafters read it from the context
    bound = Target(vocab_size, target_name, backend, target)
    try:
        if method == "ar":
            return NoDraft()
        if method in REFERENCES:
            raise SpecgraftError(f"{method} runs its library's own loop; use Engine.generate, not a drafter")
        if method == "pld":
            return _pld(opts, options, bound)
        if method == "draft":
            return _draft_model(opts["model"], bound, dtype, opts["shape"], opts["top_k"], opts["depth"], device)
        if method == "eagle":
            return _eagle(opts["head"], bound, opts["top_k"], opts["depth"])
        if method in ("graft", "prune"):
            return _graft(method, opts, bound, dtype, device)
        return TokenRecycling(vocab_size, k=opts["k"], scope=opts["scope"])
    except (ValueError, TypeError) as err:
        raise SpecgraftError(str(err)) from err


def _pld(opts: dict, given: dict, bound: Target):
    if opts["length"] == "budget":
        if "chains" in given:
            raise SpecgraftError("pld's chains option belongs to length=cost (plain PLD drafts one chain)")
        return PromptLookup(max_ngram=opts["max_ngram"])
    if opts["length"] != "cost":
        raise SpecgraftError(f"pld length must be budget or cost, got {opts['length']!r}")
    if bound.backend is None:
        raise SpecgraftError("pld length=cost sizes its drafts from the target's measured cost curve: "
                             "it runs through an engine (a backend), not on a bare model")
    for key in ("max_ngram", "chains"):  # refused before a missing curve is measured (a minute or more)
        if not isinstance(opts[key], int) or isinstance(opts[key], bool) or opts[key] < 1:
            raise SpecgraftError(f"pld needs an integer {key} >= 1, got {opts[key]!r}")
    curve = backend_curve(bound.name, bound.backend)  # cached per machine; measured once on an idle backend
    cal, where = context_calibration(bound.name)
    return CostSizedLookup(curve_cost(curve), ContextModel.from_fit(cal.context if cal else None, where),
                           max_ngram=opts["max_ngram"], chains=opts["chains"],
                           curve_source=backend_key(bound.name, bound.backend.capabilities))


def context_calibration(target_name: str) -> tuple[Calibration | None, str]:
    """The first shipped (or user) calibration of the target with a context table, and where it is ("prior"
    when none): the table depends on the target only, so any drafter's calibration serves."""
    for drafter in INNER_KINDS:
        cal, path = find_calibration({"drafter": drafter, "calibration": "auto"}, target_name)
        if cal is not None and cal.context:
            return cal, path
    return None, "prior"


def _draft_backend(model, dtype: str, device: str, bound: Target) -> tuple[Backend, str]:
    """``model``: a registry name or a local path (on the target backend's runtime: its draft factory), or an
    already loaded ``nn.Module`` / backend (tests)."""
    if not isinstance(model, str):
        return (TargetBackend(model) if isinstance(model, torch.nn.Module) else model), type(model).__name__
    if bound.backend is not None:
        return bound.backend.draft_backend(model), model
    return TargetBackend(load(model, dtype, device=device)[0]), model


def _draft_model(model, bound: Target, dtype: str, shape: str, top_k: int, depth: int,
                 device: str = "cpu") -> DraftModelDrafter:
    draft, label = _draft_backend(model, dtype, device, bound)
    if draft.vocab_size != bound.vocab_size:
        raise SpecgraftError(f"draft model '{label}' has a vocabulary of {draft.vocab_size} tokens but the target "
                             f"has {bound.vocab_size}; a draft model must share the target's tokenizer")
    return DraftModelDrafter(draft, label, shape, top_k, depth)


def shipped_head(target_name: str):
    """The head committed for a registry model (``src/specgraft/heads/<name>``), or None."""
    path = Path(__file__).resolve().parent / "heads" / target_name
    return path if (path / "config.json").exists() else None


def _eagle(head, bound: Target, top_k: int, depth: int) -> EagleDrafter:
    """``head``: "auto" (the head shipped for the target), a checkpoint directory, or a loaded head (tests)."""
    if bound.backend is None and bound.model is None:
        raise SpecgraftError("method 'eagle' needs the target model (use Engine.drafter)")
    if not bound.hidden_states:
        raise SpecgraftError(f"EAGLE-3 heads read the target's hidden states, which the {bound.backend.capabilities.shown} "
                             "backend does not expose: use --backend transformers for eagle, or graft/prune with "
                             "--opt drafter=draft-tree / draft-chain")
    target, target_name = bound.head_target, bound.name
    if isinstance(head, Eagle3Head):
        return EagleDrafter(head, "custom", top_k, depth)
    path = shipped_head(target_name) if head == "auto" else head
    if path is None:
        raise SpecgraftError(f"no EAGLE-3 head ships for model '{target_name}'; pass --opt head=DIR or train one "
                             "with `specgraft train-head`")
    loaded = load_head(path, target)
    if next(loaded.parameters()).device.type == "cpu":
        prepack(loaded)  # batched drafting runs 2-60 rows per pass: the plain kernels' worst widths (packed.py)
    return EagleDrafter(loaded, str(head if head != "auto" else f"auto ({target_name})"), top_k, depth)


INNER_KINDS = ("eagle", "draft-tree", "draft-chain")


def inner_drafter(opts: dict, bound: Target, dtype: str = "float32", device: str = "cpu"):
    kind = opts["drafter"]
    if kind not in INNER_KINDS:
        raise SpecgraftError(f"unknown drafter '{kind}' for {opts.get('variant', 'prune')}; choose one of: "
                             f"{', '.join(INNER_KINDS)}")
    if kind == "eagle":
        d = DEFAULTS["eagle"]
        return _eagle(opts["head"], bound, d["top_k"] if opts["top_k"] == "auto" else opts["top_k"],
                      d["depth"] if opts["depth"] == "auto" else opts["depth"])
    d = DEFAULTS["draft"]
    return _draft_model(opts["model"], bound, dtype, kind.split("-")[1],
                        d["top_k"] if opts["top_k"] == "auto" else opts["top_k"],
                        d["depth"] if opts["depth"] == "auto" else opts["depth"], device)


def calibration_dir(opts: dict, target_name: str):
    """Where ``specgraft calibrate`` writes and Graft reads: ``<head dir>/graft-<drafter>`` (the shipped head's
    directory for draft models too), else the user cache."""
    kind = opts["drafter"]
    base = None
    if kind == "eagle" and opts.get("head", "auto") != "auto" and isinstance(opts["head"], (str, Path)):
        base = Path(opts["head"])
    elif shipped_head(target_name) is not None:
        base = shipped_head(target_name)
    if base is None:
        base = cache_root() / "graft" / target_name
    return base / f"graft-{kind}"


def find_calibration(opts: dict, target_name: str, required: bool = False) -> tuple[Calibration | None, str]:
    """The calibration a tree method's options name, and where it is: ``calibration`` "auto" (beside the head,
    ``calibration_dir``), "none", or a directory. ``(None, "fallback")`` when there is none, unless it was named
    explicitly or is ``required`` (one clear error). Graft's drafter, ``auto`` and the server's policy read
    calibrations only through this."""
    where = opts.get("calibration", "auto")
    if where == "none":
        if required:
            raise SpecgraftError("this needs a calibration, but calibration=none was given")
        return None, "fallback"
    path = calibration_dir(opts, target_name) if where in ("auto", None) else Path(where)
    if (path / "calibration.json").exists():
        return Calibration.load(path), str(path)
    if required or where not in ("auto", None):
        raise SpecgraftError(f"no calibration in {path} (run `specgraft calibrate`)")
    return None, "fallback"


def _graft(method: str, opts: dict, bound: Target, dtype: str, device: str = "cpu"):
    inner = inner_drafter(opts, bound, dtype, device)
    cal, where = find_calibration(opts, bound.name)
    vocab_size = bound.vocab_size
    thresholds = cal.thresholds if cal else None
    if opts["rho"] != "auto":  # thresholds at another rho, from the stored fits
        if cal is None or not 0 < float(opts["rho"]) < 1:
            raise SpecgraftError("rho needs a calibration and a value in (0, 1)")
        thresholds = cal.thresholds_for(float(opts["rho"]))
    if method == "prune":
        param = None if opts["param"] == "auto" else float(opts["param"])
        policy = make_policy(opts["policy"], thresholds, param)
        return GraftDrafter(inner, vocab_size, "prune", policy, name=f"prune-{opts['policy']}", calibration=where,
                            tau_tail=cal.tau_tail if cal else 0.1,
                            calibration_info=cal.provenance() if cal else None)
    k = opts["k"]
    # matrix: "auto" = the calibration's warm-up snapshot, "cold" = none, or another calibration directory's
    src = cal if opts["matrix"] == "auto" else None
    if opts["matrix"] not in ("auto", "cold"):
        src = Calibration.load(Path(opts["matrix"]))
    snapshot = src.snapshot if src is not None and src.snapshot is not None \
        and int(src.snapshot["succ"].shape[1]) == k else None
    sweep = None
    if (opts["tpl_depth"], opts["tpl_width"]) != ("auto", "auto"):
        sweep = (9 if opts["tpl_depth"] == "auto" else int(opts["tpl_depth"]),
                 10 if opts["tpl_width"] == "auto" else int(opts["tpl_width"]))
        if sweep[0] < 1 or sweep[1] < 1:
            raise SpecgraftError("tpl_depth and tpl_width must be >= 1")
    if str(opts["context"]) not in CONTEXT_SWITCH:
        raise SpecgraftError(f"graft context must be on or off, got {opts['context']!r}")
    ctx_model = ContextModel.from_fit(cal.context if cal else None, where)
    return GraftDrafter(inner, vocab_size, opts["variant"], make_policy("echo", thresholds), k=k,
                        scope=opts["scope"], snapshot=snapshot, dedup=opts["dedup"],
                        tau_tail=cal.tau_tail if cal else 0.1, rank_weights=cal.rank_weights if cal else None,
                        calibration=where, sweep=sweep, matrix_source=str(opts["matrix"]),
                        calibration_info=cal.provenance() if cal else None,
                        context=CONTEXT_SWITCH[str(opts["context"])], context_model=ctx_model,
                        ctx_ngram=opts["ctx_ngram"], ctx_chains=opts["ctx_chains"],
                        head_expected=cal.head_expected() if cal else None)


CONTEXT_SWITCH = {"on": True, "off": False, "True": True, "False": False, "1": True, "0": False}


def chain_drafter(method: str, options: dict) -> bool:
    """Does this method propose chains that carry the draft distribution ``q`` they were sampled from?"""
    if method == "draft":
        return options.get("shape", DEFAULTS["draft"]["shape"]) == "chain"
    if method == "graft":
        return options.get("drafter", DEFAULTS["graft"]["drafter"]) == "draft-chain"
    return False


def check_lossy(rule: Rule, method: str, options: dict, sampling: SamplingParams) -> None:
    """Refuse a LOSSY rule where it cannot run: greedy decoding, no speculation, or a rule that needs ``q``
    on candidates that do not carry it."""
    if sampling.greedy:
        raise SpecgraftError(f"{rule.spec} needs sampling (temperature > 0); greedy verification has no lossy rules")
    if method in ("ar", *REFERENCES):
        raise SpecgraftError(f"{rule.spec} needs a speculative method, not '{method}'")
    # Graft-TAIL chains carry one-hot q for retrieved tokens: mixing rules (cos, interp, cap) would accept
    # those with probability >= 1 - lam whatever the target says, so they need a sampled draft chain.
    if rule.needs_q and not (method == "draft" and chain_drafter(method, options)):
        raise SpecgraftError(f"lossy rule '{rule.name}' needs draft probabilities: use a chain drafter "
                             f"(method draft with shape=chain), not '{method}'")


__all__ = ["DEFAULTS", "METHODS", "Target", "check_lossy", "check_options", "find_calibration", "make_drafter"]
