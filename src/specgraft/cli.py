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


def _method_options(method: str, pld_max_ngram, recycle_k, recycle_scope) -> dict:
    opts = {"pld": {"max_ngram": pld_max_ngram}, "recycle": {"k": recycle_k, "scope": recycle_scope}}.get(method, {})
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
    cache_dir: Optional[str] = typer.Option(None, help="Where converted models live (default: user cache)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON record instead of streaming text."),
) -> None:
    """Generate a reply, streaming text, then print one statistics line (to stderr)."""
    from .decode import Engine
    from .sampling import SamplingParams

    sampling = SamplingParams(temperature, top_k, top_p, seed)
    opts = _method_options(method, pld_max_ngram, recycle_k, recycle_scope)
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
    prompts: str = typer.Option("mtbench", help="Dataset (mtbench, humaneval, gsm8k, mbpp) or a .jsonl/.txt file."),
    methods: str = typer.Option("ar,pld,recycle", help="Comma-free list separated by ';', e.g. 'ar;pld;recycle:budget=32'. "
                                "AR is always added as the baseline."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m"),
    dtype: str = typer.Option("bfloat16"),
    limit: Optional[int] = typer.Option(8, help="Use the first N prompts (after --stride)."),
    stride: int = typer.Option(1, help="Take every K-th prompt (10 on MT-Bench = one per category)."),
    max_new_tokens: int = typer.Option(128),
    temperature: float = typer.Option(0.0),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    seed: Optional[int] = typer.Option(0),
    warmup: int = typer.Option(1, help="Warm-up generations per method before timing."),
    out: Optional[str] = typer.Option(None, help="Append one JSONL record per (prompt, method)."),
    cache_dir: Optional[str] = typer.Option(None),
) -> None:
    """Run methods side by side on the same prompts, interleaved; print MAT and speedup over AR."""
    from rich.progress import Progress

    from .bench import format_table, parse_method, run_bench
    from .decode import Engine
    from .prompts import load_prompts
    from .sampling import SamplingParams

    sampling = SamplingParams(temperature, top_k, top_p, seed)
    sep = ";" if ";" in methods else ","
    specs = [parse_method(s) for s in methods.split(sep) if s.strip()]
    for s in specs:
        if s.method not in METHODS:
            raise SpecgraftError(f"unknown method '{s.method}'; choose one of: {', '.join(METHODS)}")
    if limit is not None and limit < 1:
        raise SpecgraftError("--limit must be >= 1")
    if stride < 1:
        raise SpecgraftError("--stride must be >= 1")
    items = load_prompts(prompts, limit, stride)
    _quiet_transformers()
    engine = Engine(model, dtype, cache_dir)
    n_methods = len(specs) + (0 if any(s.method == "ar" for s in specs) else 1)
    with Progress(transient=True) as bar:
        task = bar.add_task(f"bench {prompts} ({len(items)} prompts)", total=len(items) * n_methods)
        result = run_bench(engine, items, specs, sampling, max_new_tokens, warmup, out,
                           progress=lambda label, pid: bar.update(task, advance=1, description=f"{label} @ {pid}"))
    info = result["machine"]
    print(f"model={model} dtype={dtype} prompts={prompts} n={len(items)} stride={stride} max_new_tokens={max_new_tokens} "
          f"sampling={sampling.to_dict()} commit={info['commit']} threads={info['threads']}")
    print(format_table(result))
    bad = {k: v for k, v in result["mismatches"].items() if v}
    if bad:
        print(f"error: greedy outputs differ from AR: {bad}", file=sys.stderr)
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
