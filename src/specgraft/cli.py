"""Command line: ``specgraft generate``, ``specgraft bench``, ``specgraft models``.

Errors caused by input or environment print one line (``error: ...``) and exit with status 2.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from .drafters import DEFAULTS, METHODS
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
                    draft_depth) -> dict:
    opts = {"pld": {"max_ngram": pld_max_ngram}, "recycle": {"k": recycle_k, "scope": recycle_scope},
            "draft": {"model": draft_model, "shape": draft_shape, "top_k": draft_top_k, "depth": draft_depth},
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
    max_new_tokens: int = typer.Option(128, help="Maximum number of generated tokens."),
    dtype: str = typer.Option("bfloat16", help="float32 (exact reference) or bfloat16 (2-3x faster on CPU)."),
    budget: Optional[int] = typer.Option(None, help="Tree node budget (non-root nodes); default per method."),
    stop: list[str] = typer.Option([], help="Stop string (repeatable)."),
    chat: bool = typer.Option(True, help="Apply the model's chat template."),
    pld_max_ngram: Optional[int] = typer.Option(None, help="pld: longest n-gram to look up."),
    recycle_k: Optional[int] = typer.Option(None, help="recycle: successors per adjacency row."),
    recycle_scope: Optional[str] = typer.Option(None, help="recycle: cold (per prompt) or hot (kept)."),
    draft_model: Optional[str] = typer.Option(None, help="draft: the draft LM (same tokenizer as the target)."),
    draft_shape: Optional[str] = typer.Option(None, help="draft: chain (gamma = budget) or tree (top-k, rerank)."),
    draft_top_k: Optional[int] = typer.Option(None, help="draft tree: children per expanded node."),
    draft_depth: Optional[int] = typer.Option(None, help="draft tree: expansion levels after the first."),
    cache_dir: Optional[str] = typer.Option(None, help="Where converted models live (default: user cache)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON record instead of streaming text."),
) -> None:
    """Generate a reply, streaming text, then print one statistics line (to stderr)."""
    from .decode import Engine
    from .sampling import SamplingParams

    sampling = SamplingParams(temperature, top_k, top_p, seed)
    opts = _method_options(method, pld_max_ngram, recycle_k, recycle_scope, draft_model, draft_shape, draft_top_k,
                           draft_depth)
    if method not in METHODS:
        raise SpecgraftError(f"unknown method '{method}'; choose one of: {', '.join(METHODS)}")
    _quiet_transformers()
    engine = Engine(model, dtype, cache_dir)
    stream = engine.stream(prompt, method, sampling=sampling, max_new_tokens=max_new_tokens, stop=tuple(stop),
                           chat=chat, budget=budget, **opts)
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

    from .harness import BenchConfig, expand_methods, parse_method, run_harness
    from .report import load, markdown

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
) -> None:
    """Tables per category and overall, the exactness check, and plots. Exit 1 if the check fails."""
    from pathlib import Path

    from .report import load, markdown, plots

    for r in records:
        if not Path(r).exists():
            raise SpecgraftError(f"records file not found: {r}")
    rep = load(records)
    if not rep.records:
        raise SpecgraftError("no complete records in " + ", ".join(records))
    text = markdown(rep, command)
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
