"""``specgraft serve`` (the OpenAI-compatible server) and ``specgraft loadtest`` (its load generator)."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ..errors import SpecgraftError
from ..models import DEFAULT_MODEL, REGISTRY
from .app import DTYPE_HELP, app, quiet_transformers


@app.command()
def serve(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help=f"{', '.join(REGISTRY)} or a local HF directory."),
    method: str = typer.Option("auto", help="Default method for requests that name none (a request's `method` "
                               "field overrides it); auto = the fastest lossless method on this machine."),
    budget: Optional[str] = typer.Option(None, help="Default tree budget (or 'auto')."),
    opt: list[str] = typer.Option([], help="Default method option KEY=VALUE (repeatable)."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP + " Default auto: a server's steps are batches."),
    backend: str = typer.Option("transformers", help="transformers, llamacpp (the GGUF on llama.cpp; no EAGLE) or "
                                "auto (the backend and weights predicted fastest here for one request at a time)."),
    device: str = typer.Option("cpu", help="cpu, cuda or auto (transformers backend): where the target and a draft "
                               "model run; drafting bookkeeping, EAGLE heads and verification stay on the CPU."),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    max_num_seqs: int = typer.Option(8, help="Requests verified together in one batched forward."),
    max_queue: int = typer.Option(128, help="Requests waiting for a slot; beyond it: 429 with Retry-After."),
    request_timeout: float = typer.Option(600.0, help="Seconds from arrival before a request is aborted (0 = none)."),
    max_tokens: int = typer.Option(256, help="Completion length when a request sets no max_tokens."),
    batch_budget: bool = typer.Option(True, help="Shrink each request's tree as the batch grows (lossless; "
                                      "docs/serving.md)."),
    served_model_name: Optional[str] = typer.Option(None, help="The model id clients send (default: --model)."),
    methods: Optional[str] = typer.Option(None, help="Methods a request may choose, comma-separated; their drafters "
                                          "are built at start-up (default: every method that builds here)."),
    max_budget: int = typer.Option(128, help="The largest tree budget a request may ask for."),
    client_options: str = typer.Option("none", help="Method options a request may set: none, all (trusted "
                                       "clients), or KEY,KEY (docs/serving.md, Hardening)."),
    api_key: Optional[str] = typer.Option(None, envvar="SPECGRAFT_API_KEY", help="Require 'Authorization: "
                                          "Bearer KEY' on /v1/* (also from $SPECGRAFT_API_KEY)."),
    max_body_bytes: int = typer.Option(4 << 20, help="Largest request body; beyond it: 413."),
    replicas: int = typer.Option(0, help="Run N replicas on Ray Serve instead of one uvicorn process "
                                 "(needs specgraft[ray]); 0 = no Ray."),
    num_cpus: float = typer.Option(1.0, help="Ray: CPUs reserved per replica."),
    max_replicas: int = typer.Option(0, help="Ray: autoscale between --replicas and this (0 = fixed)."),
    cache_dir: Optional[str] = typer.Option(None, help="Where converted models live (default: user cache)."),
    log_level: str = typer.Option("info", help="uvicorn log level."),
) -> None:
    """Serve the model over OpenAI's API (chat, completions, models), with /metrics and a playground at /."""
    from ..eval.harness import parse_budget, parse_opts
    from ..serve.launch import build_server

    opts, budget_v = parse_opts(opt), parse_budget(budget)
    if replicas:
        from ..serve.ray import run_ray

        run_ray(dict(model=model, dtype=dtype, method=method, budget=budget_v, opts=opts, name=served_model_name,
                     max_num_seqs=max_num_seqs, max_queue=max_queue, timeout=request_timeout,
                     max_tokens=max_tokens, cache_dir=cache_dir, batch_budget=batch_budget, backend=backend,
                     device=device, methods=methods, max_budget=max_budget, client_options=client_options,
                     api_key=api_key, max_body_bytes=max_body_bytes), replicas, num_cpus, max_replicas, host, port)
        return
    import uvicorn

    from ..serve.app import create_app

    quiet_transformers()
    server = build_server(model, dtype, method, budget_v, opts, served_model_name, max_num_seqs, max_queue,
                          request_timeout, max_tokens, cache_dir, batch_budget, backend, device, methods, max_budget,
                          client_options, api_key, max_body_bytes)
    print(f"serving {server.name} ({server.method}) on http://{host}:{port}  (playground: /, metrics: /metrics)",
          file=sys.stderr)
    try:
        uvicorn.run(create_app(server), host=host, port=port, log_level=log_level)
    finally:
        server.runner.stop()


@app.command()
def loadtest(
    url: str = typer.Option("http://127.0.0.1:8000", help="A running `specgraft serve`."),
    methods: str = typer.Option("ar;graft", help="Methods to compare, ';'-separated, each METHOD[:key=value,...] "
                                "(e.g. 'ar;graft:budget=7'); include ar for the ratios."),
    concurrency: str = typer.Option("1,4,16", help="Closed-loop client counts."),
    rounds: int = typer.Option(2, help="Passes over every (concurrency, method) cell, order rotated."),
    prompts: str = typer.Option("mtbench", help="Dataset (mtbench, humaneval, gsm8k, ...) or a .jsonl file."),
    limit: int = typer.Option(16, help="Prompts per cell (first turns)."),
    stride: int = typer.Option(1, help="Take every n-th prompt."),
    max_tokens: int = typer.Option(64, help="Tokens per request (greedy)."),
    out: str = typer.Option("runs/loadtest.jsonl", help="Per-request records (JSONL; a rerun resumes)."),
) -> None:
    """Measure a running server: requests/s, tokens/s, TTFT and inter-token latency per concurrency and method."""
    from pathlib import Path

    import httpx

    from ..env import environment
    from ..eval.datasets import load_dataset
    from ..eval.loadtest import prompt_table, run_loadtest, summary, table

    specs = [s.strip() for s in methods.split(";") if s.strip()]
    try:
        levels = [int(x) for x in concurrency.split(",")]
    except ValueError:
        raise SpecgraftError(f"--concurrency must be integers separated by commas, got '{concurrency}'") from None
    if not specs or any(c < 1 for c in levels) or rounds < 1 or max_tokens < 1:
        raise SpecgraftError("need at least one method, concurrency >= 1, rounds >= 1, max tokens >= 1")
    try:
        info = httpx.get(url.rstrip("/") + "/v1/models", timeout=10).json()["data"][0]
    except (httpx.HTTPError, KeyError, ValueError) as err:
        raise SpecgraftError(f"no specgraft server at {url}: {err}") from None
    items = load_dataset(prompts, limit=limit, stride=stride)
    meta = {"model": info["id"], "dtype": info.get("specgraft", {}).get("dtype"), "max_tokens": max_tokens,
            "prompts": prompts, **{k: v for k, v in environment().items() if k in ("commit", "dirty", "cpu")},
            "date": __import__("datetime").date.today().isoformat()}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    records = run_loadtest(url.rstrip("/"), specs, [(it.id, it.turns[0]) for it in items], levels, rounds,
                           max_tokens, out, meta, log=lambda s: print(s, file=sys.stderr))
    print(table(summary(records)))
    for c in levels:
        print(f"\nPer prompt, concurrency {c}:\n" + prompt_table(records, c))
