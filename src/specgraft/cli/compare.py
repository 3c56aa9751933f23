"""``specgraft generate --compare``: AR and a speculative method on the same prompt, same loaded engine.

A short warm-up generation of both methods on a fixed prompt comes first (the first timed run would otherwise
pay for lazy loading: the drafter, kernels), then AR, then the method. Texts are coloured by where each
token came from (``RequestOutput.segments``, engine.TOKEN_SOURCES).
"""

from __future__ import annotations

import json

from rich.console import Console
from rich.text import Text

from ..errors import SpecgraftError

WARMUP_PROMPT = "List the four seasons, one per line."  # fixed and in no dataset, like bench's warm-up
WARMUP_TOKENS = 16

# The target's own tokens keep the terminal's default colour (readable on any theme); accepted candidates use
# ANSI green / magenta / red, which read on dark and light backgrounds alike (yellow, cyan and white vanish on light
# themes, blue on dark ones). The prefill token is underlined rather than coloured.
STYLES = {"prefill": "underline", "head": "bold green", "matrix": "bold magenta", "context": "bold red", "bonus": ""}
LABELS = {"prefill": "prefill (first token)", "head": "draft head / draft model", "matrix": "matrix (retrieval)",
          "context": "context (copied from earlier)", "bonus": "target (bonus)"}


def run_request(engine, prompt, method: str, budget, options: dict, **kwargs):
    """One request through ``add_request`` + ``step``: its Generation and its text as (run, source) pieces."""
    rid = engine.add_request(prompt, method, budget=budget, **kwargs, **options)
    segments: list[tuple[str, str]] = []
    while True:
        for out in engine.step():
            if out.request_id != rid:
                continue
            for piece, src in out.segments:
                if segments and segments[-1][1] == src:
                    segments[-1] = (segments[-1][0] + piece, src)
                else:
                    segments.append((piece, src))
            if out.finished:
                if out.error is not None:
                    raise RuntimeError(f"{method} failed: {out.error}")
                return out.result, segments


def partner(method: str, budget, options: dict, choice):
    """The speculative side of the comparison: the method itself, or, when auto chose AR, the candidate it
    predicted best (so the comparison shows what AR beat)."""
    if method != "ar":
        return method, budget, options
    rows = choice.table[1:] if choice is not None else []
    if not rows:
        raise SpecgraftError("--compare needs a speculative method to compare with AR; name one with --method")
    best = max(rows, key=lambda r: r["tokens_per_s"])
    return best["method"], best["budget"], dict(best["options"])


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def compare(engine, prompt, method: str, budget, options: dict, choice, as_json: bool, sampling, max_new_tokens: int,
            stop: tuple[str, ...], chat: bool, rule) -> None:
    if method == "hf_assisted":
        raise SpecgraftError("--compare runs methods of the engine loop; hf_assisted runs transformers' own loop")
    method, budget, options = partner(method, budget, options, choice)
    kwargs = {"sampling": sampling, "stop": stop, "chat": chat}
    for m, b, o, v in (("ar", None, {}, "lossless"), (method, budget, options, rule)):  # warm-up, not timed
        run_request(engine, WARMUP_PROMPT, m, b, o, verify=v, max_new_tokens=min(WARMUP_TOKENS, max_new_tokens),
                    **kwargs)
    ar, ar_segs = run_request(engine, prompt, "ar", None, {}, max_new_tokens=max_new_tokens, **kwargs)
    sd, sd_segs = run_request(engine, prompt, method, budget, options, verify=rule, max_new_tokens=max_new_tokens,
                              **kwargs)
    if choice is not None:
        for g in (ar, sd):
            g.config["auto"] = choice.to_dict()
    ratio = sd.stats.tokens_per_s / ar.stats.tokens_per_s if ar.stats.tokens_per_s else float("nan")
    diff = first_difference(ar.token_ids, sd.token_ids)
    gap = logit_gap(engine, ar, sd, diff) if diff is not None and sampling.greedy and not rule.lossy else None
    verdict = note(diff, sampling, rule, engine.capabilities, gap)
    if as_json:
        print(json.dumps({"ar": ar.to_record(), "method": sd.to_record(), "speed_ratio": ratio,
                          "identical": diff is None, "first_difference": diff, "note": verdict,
                          "auto": choice.to_dict() if choice is not None else None}))
        return
    label = sd.config.get("method", method) + "".join(f" {k}={v}" for k, v in options.items()) + \
        f" (budget {sd.config.get('budget')})"
    con = Console(highlight=False, soft_wrap=True)
    mode = "greedy" if sampling.greedy else f"sampling (temperature {sampling.temperature}, seed {sampling.seed})"
    con.print(f"compare: {engine.model_name} {engine.dtype}, {mode}, up to {max_new_tokens} new tokens, "
              f"after a {WARMUP_TOKENS}-token warm-up of both")
    legend = Text("legend: ")
    for i, (src, style) in enumerate(STYLES.items()):
        legend.append(" | " if i else "")
        legend.append(LABELS[src], style=style)
    con.print(legend)
    for name, g, segs in (("ar", ar, ar_segs), (label, sd, sd_segs)):
        con.rule(name, align="left", style="dim")
        con.print(Text.assemble(*((piece, STYLES.get(src, "")) for piece, src in segs)))
        con.print(f"{name}: {g.stats.tokens_per_s:.1f} tok/s, MAT {g.stats.mat:.2f}, {g.stats.new_tokens} tokens "
                  f"in {g.stats.total_s:.2f} s, {g.stats.steps} steps")
    con.rule(style="dim")
    # The one line to read after a long text: the speed-up in bold, and the MAT that explains it.
    con.print(Text.assemble(f"speed ratio {sd.config.get('method', method)} / ar: ", (f"{ratio:.2f}x", "bold"),
                            f" ({sd.stats.tokens_per_s:.1f} vs {ar.stats.tokens_per_s:.1f} tok/s), "
                            f"MAT {sd.stats.mat:.2f} vs {ar.stats.mat:.2f} (tokens per target forward)"))
    con.print(verdict)


def logit_gap(engine, g_ar, g_sd, i: int) -> tuple[float, float]:
    """(|logit gap| of the two tokens at the first difference, the top logit): a one-off full forward."""
    import torch

    ids = torch.tensor(g_ar.prompt_ids + g_ar.token_ids[:i])
    with torch.no_grad():
        logits = engine.backend.clone().prefill(ids).logits[-1].float()  # a fresh cache: either backend
    a, b = (int(g.token_ids[i]) if i < len(g.token_ids) else None for g in (g_ar, g_sd))
    if a is None or b is None:
        return float("nan"), float(logits.max())
    return abs(float(logits[a] - logits[b])), float(logits.max())


def note(diff: int | None, sampling, rule, caps, gap: tuple[float, float] | None = None) -> str:
    if diff is None:
        return "texts identical: the speculative output equals AR token for token (lossless)"
    head = f"NOTE: the texts differ from token {diff} on: "
    if rule.lossy:
        return head + f"{rule.spec} is LOSSY (opt-in); its output does not follow the target distribution."
    if not sampling.greedy:
        return head + "under sampling each method consumes randomness differently; the outputs agree in " \
                      "distribution, not token for token (lossless in distribution)."
    where = f"the target's logits for the two tokens there are {gap[0]:.3g} apart (top logit {gap[1]:.1f}), " \
        if gap else ""
    tie = gap is not None and gap[0] <= caps.tie_gap  # the backend declares where near-ties start
    if tie:
        return head + where + f"a near-tie: {caps.tie_note}."
    return head + where + "not a near-tie: greedy speculative output should equal AR; please report this."
