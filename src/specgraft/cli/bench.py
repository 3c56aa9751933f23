"""``specgraft bench``, ``report`` and ``batch``: measuring and reporting."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ..errors import SpecgraftError
from ..models import DEFAULT_MODEL, resolve_dtype
from .app import app, quiet_transformers


@app.command()
def bench(
    config: Optional[str] = typer.Option(None, help="TOML config (model, dtype, datasets, methods with sweeps, seeds); "
                                         "the flags below override it."),
    prompts: Optional[str] = typer.Option(None, help="Dataset (mtbench, humaneval, mbpp, gsm8k, sharegpt, copyheavy) or a .jsonl/.txt file."),
    methods: Optional[str] = typer.Option(None, help="';'-separated, e.g. 'pld;recycle:budget=16'. AR is always added."),
    model: Optional[str] = typer.Option(None, "--model", "-m"),
    dtype: Optional[str] = typer.Option(None, help="bfloat16 (default), float32, int4 or auto (float32 where the "
                                        "CPU has no packed bf16 path); overrides the config's."),
    backend: Optional[str] = typer.Option(None, help="transformers (default) or llamacpp (the GGUF on llama.cpp)."),
    device: Optional[str] = typer.Option(None, help="cpu (default), cuda or auto (transformers backend)."),
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

    from ..eval.harness import BenchConfig, expand_methods, parse_method, run_harness
    from ..eval.report import load, markdown

    cfg = BenchConfig.from_toml(config) if config else BenchConfig()
    for name, val in (("model", model), ("dtype", dtype), ("backend", backend), ("device", device), ("max_new_tokens", max_new_tokens), ("warmup", warmup),
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
    weights = resolve_dtype(cfg.dtype, cfg.device) if cfg.backend == "transformers" else cfg.backend
    out = out or f"runs/bench-{cfg.model.replace('/', '_')}-{weights}.jsonl"
    quiet_transformers()
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
    study: bool = typer.Option(False, "--study", help="Also the lossy study's tables: a verdict per claim of the lossy "
                               "paper, and every point beside its correct baseline with paired bootstrap intervals."),
    distortion: Optional[str] = typer.Option(None, help="With --study: `specgraft distortion` records whose TV / KL "
                                             "stand beside each point."),
    reference: Optional[str] = typer.Option(None, help="A method label: also speedups vs it, with 95% intervals."),
    goal: Optional[list[str]] = typer.Option(None, help="LABEL>REF:RATIO (REF may be ar), repeatable; met only "
                                             "when the 95% interval's lower bound >= RATIO. mat:LABEL>REF:RATIO "
                                             "compares MAT."),
) -> None:
    """Tables per category and overall, intervals, goals, the exactness check, and plots. Exit 1 if the check
    fails."""
    from pathlib import Path

    from ..eval.report import load, markdown, plots
    from ..eval.report_stats import parse_goal

    for g in goal or []:
        parse_goal(g)  # a bad goal fails before any file is read
    for r in [*records, *([distortion] if distortion else [])]:
        if not Path(r).exists():
            raise SpecgraftError(f"records file not found: {r}")
    if distortion and not study:
        raise SpecgraftError("--distortion goes with --study")
    rep = load(records)
    if not rep.records:
        raise SpecgraftError("no complete records in " + ", ".join(records))
    text = markdown(rep, command, reference=reference, goals=goal)
    if lossy:
        from ..eval.harness import read_records
        from ..lossy.report import markdown as lossy_markdown
        from ..lossy.report import plot as lossy_plot

        tagged = [{**r, "_file": f} for f in records for r in read_records(f)[0]]
        text += "\n## LOSSY rules vs their correct baselines\n\n" + lossy_markdown(tagged)
        if plots_dir:
            print(f"plot: {lossy_plot(tagged, Path(plots_dir) / 'quality_vs_mat.png')}", file=sys.stderr)
    if study:
        text += _study_text(records, distortion)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out + ".tmp").write_text(text, encoding="utf-8")
        Path(out + ".tmp").replace(out)
    else:
        print(text)
    if plots_dir:
        for p in plots(rep, plots_dir, reference):
            print(f"plot: {p}", file=sys.stderr)
    fp32 = {r["label"] for r in rep.records if r["dtype"] in ("float32", "fp32")}
    bad = {k: v for k, v in rep.mismatches.items() if v and (strict or k in fp32)}
    if not rep.ok or bad:
        problems = rep.problems + rep.missing + [f"{k}: {len(v)} greedy divergence(s) from AR" for k, v in bad.items()]
        what = "the run is incomplete" if not rep.problems and not bad else "exactness check failed"
        print(f"error: {what}: {problems[0]} ({len(problems)} problem(s))", file=sys.stderr)
        raise typer.Exit(1)


def _study_text(records: list[str], distortion: str | None) -> str:
    """``report --study``: the verdict table and the per-point table (eval/lossy_study.py)."""
    from ..eval.harness import read_records
    from ..eval.lossy_study import markdown as study_markdown
    from ..eval.lossy_study import verdict_table

    tagged = [{**r, "_file": f} for f in records for r in read_records(f)[0]]
    dist = None
    if distortion:
        from ..tools.distortion import aggregate

        dist = aggregate(read_records(distortion)[0])
    return ("\n## The lossy study: a verdict per claim (LOSSY rules)\n\n" + verdict_table(tagged) +
            "\n## The lossy study: every point beside its correct baseline\n\n" + study_markdown(tagged, dist))


@app.command("batch")
def batch_cmd(
    methods: str = typer.Option("ar;graft:budget=7", help="';'-separated methods with options (as in bench)."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m"),
    dtype: str = typer.Option("bfloat16", help="bfloat16, float32, int4 or auto (float32 where the CPU has no packed "
                              "bf16 path: batches are wide steps)."),
    backend: str = typer.Option("transformers", help="transformers or llamacpp (the GGUF on llama.cpp)."),
    device: str = typer.Option("cpu", help="cpu, cuda or auto (transformers backend)."),
    prompts: str = typer.Option("humaneval", help="Dataset or .jsonl/.txt file (first turns)."),
    limit: int = typer.Option(8, help="Number of prompts (all batch sizes decode the same ones)."),
    stride: int = typer.Option(1),
    batch_sizes: str = typer.Option("1,2,4,8", help="Comma-separated batch sizes."),
    max_new_tokens: int = typer.Option(64),
    out: str = typer.Option("runs/batch.jsonl", help="Records (JSONL, resumable)."),
) -> None:
    """Aggregate throughput with B requests in flight (continuous batching on the engine), per method."""
    from pathlib import Path

    from rich.progress import Progress

    from ..eval.batch_bench import run_batch_bench
    from ..eval.datasets import load_dataset
    from ..engine import Engine
    from ..eval.harness import expand_methods, parse_method

    specs = expand_methods([parse_method(m) for m in methods.split(";") if m.strip()], add_ar=False)
    try:
        sizes = sorted({int(x) for x in batch_sizes.split(",") if x.strip()})
    except ValueError:
        raise SpecgraftError(f"--batch-sizes must be comma-separated integers, got '{batch_sizes}'") from None
    if not sizes or min(sizes) < 1 or limit < 1 or max_new_tokens < 1:
        raise SpecgraftError("--batch-sizes, --limit and --max-new-tokens must be >= 1")
    if 1 not in sizes:
        sizes = [1, *sizes]  # the single-request outputs are the reference
    items = load_dataset(prompts, limit=limit, stride=stride)
    quiet_transformers()
    engine = Engine(model, dtype, backend=backend, device=device)
    ids = [engine.encode(it.turns[0]) for it in items]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with Progress() as bar:
        task = bar.add_task("batch", total=len(sizes) * len(specs))
        recs = run_batch_bench(engine, specs, ids, sizes, max_new_tokens, out,
                               progress=lambda d, t, w: bar.update(task, completed=d, total=t, description=w))
    print("| method | batch | tokens/s | MAT | x vs B=1 | host share of a step | equal to B=1 |\n"
          "|---|---|---|---|---|---|---|")
    base = {r["label"]: r["throughput"] for r in recs if r["batch_size"] == 1}
    for r in recs:
        print(f"| {r['label']} | {r['batch_size']} | {r['throughput']:.2f} | {r['mat']:.2f} | "
              f"{r['throughput'] / base[r['label']]:.2f} | {r['host_share']:.1%} | {r['equal_to_batch1']} |")
