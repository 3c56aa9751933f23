"""``specgraft distortion``: how far each LOSSY rule's output distribution is from its correct baseline, on
real prompts with the real target ``p`` and the real drafts.

- **chain** mode: decode losslessly with the draft-model chain; at every drafted position the pair
  ``(p, q)`` (target after temperature, the draft distribution the token was sampled from) gives each rule's
  closed-form induced distribution ``pi = q a + R rho`` (lossy/rules.py).
- **tree** mode: decode losslessly with the EAGLE-3 head (or Graft, or draft-model trees); at every step's root the exact
  yield of the rule's gate over the actual sibling list (``tree_node_yield``) gives ``pi``; ``mc_draws > 0``
  also runs the production verifier (``lossy.verify.lossy_tree``) that many times over the root's actual children
  and reports its TV to the exact yield (a check that the two agree).

Per rule and parameter: mean TV(pi, b), mean KL(pi || b) and KL(b || pi) over the steps where they are finite
(with the share of steps where they are infinite), against ``b`` = the rule's correct baseline (truncation
sampling ``p_A`` for SpecCascade / typical acceptance, ``p`` otherwise). Records are written per (prompt, mode)
and a rerun resumes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine import Engine
from ..eval.datasets import load_dataset
from ..eval.harness import read_records
from ..lossy.rules import Rule, kl, parse_rule, tree_node_yield, tv
from ..core.sampling import SamplingParams, make_generator, target_probs
from ..core.tree import Tree
from ..lossy.verify import lossy_tree


@dataclass
class Acc:
    n: int = 0
    tv: float = 0.0
    kl_pb: float = 0.0  # KL(pi || baseline), finite steps
    n_kl_pb: int = 0
    kl_bp: float = 0.0  # KL(baseline || pi), finite steps
    n_kl_bp: int = 0
    mc_tv: float = 0.0  # TV(MC frequencies of the production verifier, exact yield)
    n_mc: int = 0

    def add(self, pi: torch.Tensor, base: torch.Tensor) -> None:
        self.n += 1
        self.tv += tv(pi, base)
        for attr, val in (("pb", kl(pi, base)), ("bp", kl(base, pi))):
            if math.isfinite(val):
                setattr(self, "kl_" + attr, getattr(self, "kl_" + attr) + val)
                setattr(self, "n_kl_" + attr, getattr(self, "n_kl_" + attr) + 1)

    def merge(self, other: dict) -> None:
        for k, v in other.items():
            setattr(self, k, getattr(self, k) + v)

    def row(self) -> dict:
        mean = lambda s, n: s / n if n else float("nan")  # noqa: E731
        return {"steps": self.n, "tv": mean(self.tv, self.n), "kl_pi_b": mean(self.kl_pb, self.n_kl_pb),
                "kl_pi_b_inf": 1 - self.n_kl_pb / self.n if self.n else float("nan"),
                "kl_b_pi": mean(self.kl_bp, self.n_kl_bp),
                "kl_b_pi_inf": 1 - self.n_kl_bp / self.n if self.n else float("nan"),
                "mc_tv_to_exact": mean(self.mc_tv, self.n_mc)}


def chain_pairs(tree: Tree, probs: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(p, q)`` for every drafted position of a chain: ``p`` = target at the parent node."""
    if tree.draft_probs is None:
        return []
    return [(probs[i - 1].double(), tree.draft_probs[i].double()) for i in range(1, tree.size)]


def root_children(tree: Tree) -> list[int]:
    return [int(tree.tokens[c]) for c in tree.children[0]]


def mc_root_yield(rule: Rule, p: torch.Tensor, kids: list[int], n: int, gen: torch.Generator) -> torch.Tensor:
    """Empirical distribution of the first token the production tree verifier emits at the root."""
    star = Tree.build([0, *kids], [-1] + [0] * len(kids))
    probs = p.float().expand(len(kids) + 1, -1)
    counts = torch.zeros_like(p)
    for _ in range(n):
        v = lossy_tree(star, probs, rule, gen)
        counts[kids[v.accepted[1] - 1] if v.accept_length else v.bonus] += 1
    return counts / n


def measure_step(mode: str, rules: list[Rule], tree: Tree, logits: torch.Tensor, params: SamplingParams,
                 accs: dict[str, Acc], mc_draws: int, gen: torch.Generator) -> None:
    probs = target_probs(logits, params)
    if mode == "chain":
        for p, q in chain_pairs(tree, probs):
            for r in rules:
                accs[r.spec].add(r.induced(p, q), r.baseline_dist(p))
        return
    kids = root_children(tree)
    if not kids:
        return
    p = probs[0].double()
    for r in rules:
        pi = tree_node_yield(r, p, kids)
        accs[r.spec].add(pi, r.baseline_dist(p))
        if mc_draws:
            accs[r.spec].mc_tv += tv(mc_root_yield(r, p, kids, mc_draws, gen), pi)
            accs[r.spec].n_mc += 1


@dataclass
class DistortionConfig:
    model: str = "qwen2.5-coder-1.5b"
    dtype: str = "bfloat16"
    backend: str = "transformers"  # or "llamacpp": the model's GGUF, a draft model's too
    prompts: str = "humaneval"
    limit: int = 3
    stride: int = 27
    max_new_tokens: int = 64
    temperature: float = 0.7
    seed: int = 0
    rules: list[str] = field(default_factory=list)
    chain_method: tuple[str, dict] = ("draft", {"shape": "chain"})
    tree_method: tuple[str, dict] = ("eagle", {})
    tree_budget: int = 15
    mc_draws: int = 0
    chain_budget: int = 4  # gamma
    offset: int = 0  # skip the first ``offset`` prompts before taking every ``stride``-th (a held-out slice)


def run_distortion(cfg: DistortionConfig, modes: list[str], out_path: str, engine=None, progress=None) -> list[dict]:
    """Decode each prompt once per mode (lossless, T = cfg.temperature) and measure every rule at every step;
    one record per (prompt, mode) appended to ``out_path``; existing records are kept (resume)."""
    all_rules = [parse_rule(s) for s in cfg.rules]
    items = load_dataset(cfg.prompts, cfg.limit, cfg.stride, offset=cfg.offset)
    out = Path(out_path)
    done = {(r["prompt_id"], r["mode"]) for r in read_records(out)[0]}  # resume: skip measured prompts
    engine = engine or Engine(cfg.model, cfg.dtype, backend=cfg.backend)
    out.parent.mkdir(parents=True, exist_ok=True)
    total, k = len(items) * len(modes), 0
    for mode in modes:
        rules = [r for r in all_rules if mode == "chain" or not r.needs_q]
        method, opts = cfg.chain_method if mode == "chain" else cfg.tree_method
        budget = cfg.chain_budget if mode == "chain" else cfg.tree_budget
        for item in items:
            k += 1
            if (item.id, mode) in done:
                continue
            params = SamplingParams(cfg.temperature, seed=cfg.seed)
            mc_gen = make_generator(cfg.seed + 1)  # the request's own generator is seeded with cfg.seed
            accs = {r.spec: Acc() for r in rules}
            ids = engine.encode(item.turns[0])
            hook = lambda tree, logits: measure_step(mode, rules, tree, logits, params, accs,  # noqa: E731
                                                     cfg.mc_draws, mc_gen)
            engine.add_request(ids, method, sampling=params, max_new_tokens=cfg.max_new_tokens, budget=budget,
                               on_verify=hook, **opts)
            engine.run()
            rec = {"prompt_id": item.id, "mode": mode, "method": method, "options": {k: str(v) for k, v in opts.items()},
                   "model": cfg.model, "dtype": engine.dtype, "backend": engine.backend_name,
                   "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens,
                   "rules": {s: a.__dict__ for s, a in accs.items()}}
            with out.open("a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
            if progress:
                progress(k, total, f"{mode} {item.id}")
    return read_records(out)[0]


def aggregate(records: list[dict]) -> dict[tuple[str, str], dict]:
    """(mode, rule spec) -> summary row, summed over prompts."""
    accs: dict[tuple[str, str], Acc] = {}
    for rec in records:
        for spec, d in rec["rules"].items():
            accs.setdefault((rec["mode"], spec), Acc()).merge(d)
    return {k: a.row() for k, a in accs.items()}


def _fmt(x: float, inf_share: float | None = None) -> str:
    if x != x:
        return "inf" if inf_share == 1 else "–"
    s = f"{x:.3f}"
    return s + (f" ({inf_share:.0%} inf)" if inf_share else "")


def markdown_table(rows: dict[tuple[str, str], dict], specs: list[str] | None = None) -> str:
    """Rules as rows (``specs``, default: those measured), chain and tree side by side."""
    specs = list(dict.fromkeys([*(specs or []), *(spec for _, spec in rows)]))
    head = ("| Rule (LOSSY) | baseline | chain steps | chain TV | chain KL(π‖b) | chain KL(b‖π) | tree steps | "
            "tree TV | tree KL(π‖b) | tree KL(b‖π) |")
    lines = [head, "|" + "---|" * 10]
    for spec in specs:
        rule = parse_rule(spec)
        kind, v = rule.baseline()
        base = {"target": "lossless (p)", "min_p": f"min-p {v} sampling", "eta": f"eta {v} sampling"}[kind]
        cells = [spec, base]
        for mode in ("chain", "tree"):
            r = rows.get((mode, spec))
            if r is None:
                cells += ["n/a (needs q)" if mode == "tree" and rule.needs_q else "–", "–", "–", "–"]
                continue
            cells += [str(r["steps"]), _fmt(r["tv"]), _fmt(r["kl_pi_b"], r["kl_pi_b_inf"]),
                      _fmt(r["kl_b_pi"], r["kl_b_pi_inf"])]
        lines.append("| " + " | ".join(cells) + " |")
    mc = [(k, r["mc_tv_to_exact"]) for k, r in rows.items() if r["mc_tv_to_exact"] == r["mc_tv_to_exact"]]
    if mc:
        worst = max(v for _, v in mc)
        lines.append("")
        lines.append(f"Tree mode Monte Carlo (production verifier) vs exact yield: mean TV ≤ {worst:.3f} over "
                     f"{len(mc)} rules.")
    return "\n".join(lines)
