"""``specgraft generate`` and ``specgraft models``."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from ..errors import SpecgraftError
from ..models import DEFAULT_MODEL, REGISTRY
from ..registry import METHODS, REFERENCES
from .app import DEFAULTS_HELP, DTYPE_HELP, app, quiet_transformers


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
    method: str = typer.Option("auto", help=f"auto (default: the fastest lossless method predicted for this model "
                               "and machine from its measured verify latency and the shipped calibration; --budget, "
                               f"--opt and method flags need an explicit method) or one of {', '.join(METHODS)}. "
                               f"Defaults per method: {DEFAULTS_HELP}."),
    compare: bool = typer.Option(False, "--compare", help="Run AR and the method (auto's choice, or the one given) on "
                                 "the same prompt after a short warm-up; print both texts coloured by token source, "
                                 "tokens/s, MAT and the speed ratio (with --json: one object holding both records)."),
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
    dtype: str = typer.Option("bfloat16", help=DTYPE_HELP),
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
    backend: str = typer.Option("transformers", help="transformers (the HF model, --dtype), llamacpp (the GGUF "
                                "itself on llama.cpp: needs specgraft[llamacpp]; --dtype is ignored; no EAGLE) or auto "
                                "(the backend and weights predicted fastest on this machine: llama.cpp, transformers "
                                "int4 or transformers --dtype; says which and why)."),
    device: str = typer.Option("cpu", help="cpu, cuda or auto (transformers backend): where the target and a draft "
                               "model run; drafting bookkeeping, EAGLE heads and verification stay on the CPU."),
    cache_dir: Optional[str] = typer.Option(None, help="Where converted models live (default: user cache)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON record instead of streaming text."),
) -> None:
    """Generate a reply, streaming text, then print one statistics line (to stderr). --method auto (default)
    first prints its choice and why (stderr); --compare runs AR beside the method."""
    from ..core.sampling import SamplingParams
    from ..engine import Engine
    from .compare import compare as run_compare

    sampling = SamplingParams(temperature, top_k, top_p, seed, min_p, eta)
    flags = {"--pld-max-ngram": pld_max_ngram, "--recycle-k": recycle_k, "--recycle-scope": recycle_scope,
             "--draft-model": draft_model, "--draft-shape": draft_shape, "--draft-top-k": draft_top_k,
             "--draft-depth": draft_depth, "--head": head, "--eagle-top-k": eagle_top_k, "--eagle-depth": eagle_depth}
    opts = _method_options(method, pld_max_ngram, recycle_k, recycle_scope, draft_model, draft_shape, draft_top_k,
                           draft_depth, head, eagle_top_k, eagle_depth)
    opts, budget, rule = _check_request(method, compare, sampling, flags, opts, opt, budget, verify)
    quiet_transformers()
    engine = Engine(model, dtype, cache_dir, backend=backend, device=device)
    if engine.backend_choice is not None:
        print(f"backend auto: {engine.backend_choice.describe()} — {engine.backend_choice.reason}", file=sys.stderr)
    method, budget, opts, choice, stream = _open_stream(engine, prompt, method, budget, opts, sampling,
                                                        max_new_tokens, tuple(stop), chat, rule)
    if compare:
        run_compare(engine, prompt, method, budget, opts, choice, as_json, sampling, max_new_tokens, tuple(stop),
                    chat, rule)
        return
    _print_reply(stream, choice, as_json, engine.backend_choice)


def _check_request(method: str, compare: bool, sampling, flags: dict, opts: dict, opt: list[str], budget, verify: str):
    """Every check that needs no model, so a bad command line fails at once with one error line: the method
    options (flags and --opt merged), the parsed budget and the verification rule."""
    from ..eval.harness import parse_budget, parse_opts
    from ..lossy.rules import parse_rule
    from ..registry import check_lossy

    auto = method == "auto"
    if not auto and method not in METHODS:
        raise SpecgraftError(f"unknown method '{method}'; choose auto (the default) or one of: {', '.join(METHODS)}")
    opts.update(parse_opts(opt))
    budget = parse_budget(budget)
    given = [f for f, v in flags.items() if v is not None] + (["--opt"] if opt else []) + \
        (["--budget"] if budget is not None else [])
    if auto and given:  # auto picks method, budget and options together: half-overriding it is ambiguous
        raise SpecgraftError(f"{' / '.join(given)} {'needs' if len(given) == 1 else 'need'} an explicit --method "
                             "(auto chooses its own)")
    rule = parse_rule(verify)
    if rule.lossy:
        if auto:
            raise SpecgraftError(f"{rule.spec}: --method auto chooses among lossless methods only; name the method")
        check_lossy(rule, method, opts, sampling)
        print(f"warning: {rule.spec} is LOSSY: the output does not follow the target distribution", file=sys.stderr)
    if compare and method in ("ar", *REFERENCES):
        raise SpecgraftError(f"--compare compares a speculative method with AR, not '{method}' (try --method auto)")
    return opts, budget, rule


def _open_stream(engine, prompt: str, method: str, budget, opts: dict, sampling, max_new_tokens: int,
                 stop: tuple[str, ...], chat: bool, rule):
    """Resolve --method auto on the loaded engine and open the request's stream: (method, budget, options, auto's
    choice or None, stream)."""
    from ..auto import resolve

    choice = None
    if method == "auto":
        engine.encode(prompt, chat)  # a bad prompt fails before any latency measurement
        method, budget, opts, choice = resolve(engine, "auto")
    # Validates the whole request (errors raise here; nothing runs until iterated), so a bad request prints
    # one error line, not the auto choice first. --compare drives its own requests and drops this one.
    stream = engine.stream(prompt, method, sampling=sampling, max_new_tokens=max_new_tokens, stop=stop,
                           chat=chat, budget=budget, verify=rule, **opts)
    if choice is not None:
        print(f"method auto: {choice.describe()} — {choice.reason}", file=sys.stderr)
    return method, budget, opts, choice, stream


def _print_reply(stream, choice, as_json: bool, backend_choice=None) -> None:
    """The text as it is generated, then the statistics line on stderr; or, with --json, one record (with auto's
    choices in its config) once the reply is complete."""
    if as_json:
        for _ in stream:
            pass
        record = stream.result.to_record()
        if choice is not None:
            record["config"]["auto"] = choice.to_dict()
        if backend_choice is not None:
            record["config"]["backend_auto"] = backend_choice.to_dict()
        print(json.dumps(record))
        return
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(stream.result.stats.summary(), file=sys.stderr)


@app.command("models")
def list_models() -> None:
    """List the named models and where their packages come from."""
    for spec in REGISTRY.values():
        print(f"{spec.name:22s} {spec.description}  [install: {spec.install_hint}]")
