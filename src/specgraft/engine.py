"""The one decode loop, for every method:

    prefill -> [ drafter.propose (tree within budget) -> backend.verify (one forward)
                 -> rule -> backend.commit -> drafter.observe ]*

``decode_tokens`` is the loop at the token level; :class:`Engine` adds tokenisation, chat templates,
stop strings, text streaming and the drafter cache (so a "hot" retrieval matrix survives across requests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .core.backend import TargetBackend
from .registry import DEFAULTS, DraftContext, Drafter, make_drafter
from .errors import SpecgraftError
from .lossy.rules import Rule, parse_rule
from .core.sampling import SamplingParams, make_generator, target_probs
from .core.stats import Stats
from .core.tree import Tree
from .core.verify import verify_tree


def first_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """The token after the prompt, from the prefill logits (the same for every method)."""
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(target_probs(logits, params), 1, generator=gen))


def decode_tokens(backend: TargetBackend, drafter: Drafter, prompt_ids: list[int], params: SamplingParams,
                  max_new_tokens: int, budget: int, eos_ids: set[int], stats: Stats,
                  gen: torch.Generator, rule: Rule | None = None,
                  on_verify: Callable[[Tree, torch.Tensor], None] | None = None) -> Iterator[list[int]]:
    """Yield the tokens each step commits (cut at EOS, which is included, and at ``max_new_tokens``).
    ``rule``: an opt-in LOSSY verification rule (lossy.py); None = lossless. ``on_verify(tree, logits)``
    observes every verification (the distortion tool reads the real p and q there)."""
    clock = time.perf_counter
    t0 = clock()
    layers = getattr(drafter, "hidden_layers", ())  # target features a drafter reads (EAGLE heads)
    pre = backend.prefill(torch.tensor(prompt_ids, dtype=torch.long), drafter.needs_prefill_logits, layers)
    drafter.start(prompt_ids, pre.logits if drafter.needs_prefill_logits else None, pre.hidden)
    tok = first_token(pre.logits[-1], params, gen)
    stats.prefill_s += clock() - t0
    ids = [*prompt_ids, tok]
    stats.new_tokens += 1
    yield [tok]
    remaining = max_new_tokens - 1
    while remaining > 0 and tok not in eos_ids:
        t1 = clock()
        tree = drafter.propose(DraftContext(ids, budget, params))
        t2 = clock()
        out = backend.verify(tree, layers)
        t3 = clock()
        if on_verify is not None:
            on_verify(tree, out.logits)
        verdict = verify_tree(tree, out.logits, params, gen, rule)
        backend.commit(verdict.accepted)
        t4 = clock()
        drafter.observe(tree, out.logits, verdict, out.hidden)
        t5 = clock()
        new = tree.tokens[verdict.accepted[1:]].tolist() + [verdict.bonus]
        cut = next((i + 1 for i, t in enumerate(new) if t in eos_ids), len(new))
        new = new[: min(cut, remaining)]
        kids = tree.children
        stats.record_step(verdict.accept_length, [bool(kids[n]) for n in verdict.accepted], len(new),
                          tree.size - 1)
        stats.draft_s += (t2 - t1) + (t5 - t4)
        stats.verify_s += t3 - t2
        ids.extend(new)
        stats.new_tokens += len(new)
        remaining -= len(new)
        tok = new[-1]
        yield new


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: Stats
    config: dict = field(default_factory=dict)

    def to_record(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": len(self.prompt_ids),
                "config": self.config, "stats": self.stats.to_dict()}


class Stream:
    """Iterate for text pieces; ``result`` holds the :class:`Generation` once iteration ends."""

    def __init__(self, pieces: Iterator[str]):
        self._pieces = pieces
        self.result: Generation | None = None

    def __iter__(self) -> Iterator[str]:
        yield from self._pieces


def chain_drafter(method: str, options: dict) -> bool:
    """Does this method propose chains that carry the draft distribution ``q`` they were sampled from?"""
    if method == "draft":
        return options.get("shape", DEFAULTS["draft"]["shape"]) == "chain"
    if method == "graft":
        return options.get("drafter", DEFAULTS["graft"]["drafter"]) == "draft-chain"
    return False


def check_lossy(rule: Rule, method: str, options: dict, sampling: SamplingParams) -> None:
    if sampling.greedy:
        raise SpecgraftError(f"{rule.spec} needs sampling (temperature > 0); greedy verification has no lossy rules")
    if method in ("ar", "hf_assisted"):
        raise SpecgraftError(f"{rule.spec} needs a speculative method, not '{method}'")
    # Graft-TAIL chains carry one-hot q for retrieved tokens: mixing rules (cos, interp, cap) would accept
    # those with probability >= 1 - lam whatever the target says, so they need a sampled draft chain.
    if rule.needs_q and not (method == "draft" and chain_drafter(method, options)):
        raise SpecgraftError(f"lossy rule '{rule.name}' needs draft probabilities: use a chain drafter "
                             f"(method draft with shape=chain), not '{method}'")


class Engine:
    """A loaded target plus cached drafters. ``Engine("smollm2-135m")`` or ``Engine.from_model(m, tok)``."""

    def __init__(self, model: str = "smollm2-135m", dtype: str = "float32", cache_dir: str | None = None):
        from .models import load

        hf_model, tok = load(model, dtype, cache_dir)
        self._setup(hf_model, tok, model, dtype)

    @classmethod
    def from_model(cls, hf_model, tokenizer, name: str = "custom") -> "Engine":
        self = cls.__new__(cls)
        self._setup(hf_model, tokenizer, name, str(next(hf_model.parameters()).dtype).replace("torch.", ""))
        return self

    def _setup(self, hf_model, tok, name: str, dtype: str) -> None:
        self.backend = TargetBackend(hf_model)
        self.tokenizer, self.model_name, self.dtype = tok, name, dtype
        self.vocab_size = int(hf_model.get_output_embeddings().weight.shape[0])
        eos = hf_model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {int(e) for e in [*eos, tok.eos_token_id] if e is not None}
        self._drafters: dict[tuple, Drafter] = {}
        self._auto: dict[tuple, tuple[int, dict]] = {}

    def encode(self, prompt: str | list[dict], chat: bool = True) -> list[int]:
        """A user message, or a whole conversation (``[{"role", "content"}, ...]``), as prompt token ids."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not messages or not all(isinstance(m.get("content"), str) for m in messages) \
                or not messages[-1]["content"].strip():
            raise SpecgraftError("empty prompt")
        if chat and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False).input_ids
        return self.tokenizer("\n\n".join(m["content"] for m in messages)).input_ids

    def drafter(self, method: str, **options) -> Drafter | None:
        options.pop("budget", None)
        if method == "hf_assisted":  # not a drafter: load (and check) the assistant now, run HF's loop later
            from .reference import _assistant

            _assistant(options.get("model", DEFAULTS[method]["model"]), self.dtype, self.vocab_size)
            return None
        key = (method, tuple(sorted(options.items())))
        if key not in self._drafters:
            self._drafters[key] = make_drafter(method, self.vocab_size, self.dtype, target=self.backend.model,
                                               target_name=self.model_name, **options)
        return self._drafters[key]

    def auto_budget(self, method: str, options: dict) -> tuple[int, dict]:
        """``budget="auto"``: resolved once per method and options (autotune.py), then cached."""
        from .graft.autotune import auto_budget

        key = ("auto", method, tuple(sorted((k, str(v)) for k, v in options.items())))
        if key not in self._auto:
            self._auto[key] = auto_budget(self, method, options)
        return self._auto[key]

    def stream(self, prompt: str | list[dict] | list[int], method: str = "ar", *, sampling: SamplingParams | None = None,
               max_new_tokens: int = 128, stop: tuple[str, ...] = (), chat: bool = True,
               budget: int | None = None, verify: str | Rule = "lossless", **method_options) -> Stream:
        """Validate everything up front (errors raise here, not mid-stream), then return a lazy stream.

        ``verify``: ``"lossless"`` (default) or an opt-in LOSSY rule ``"lossy:RULE:PARAM"`` (lossy.py)."""
        sampling = sampling or SamplingParams()
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SpecgraftError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        rule = parse_rule(verify)
        if rule.lossy:
            check_lossy(rule, method, method_options, sampling)
        drafter = self.drafter(method, **method_options)
        budget = DEFAULTS[method]["budget"] if budget is None else budget
        auto = None
        if budget == "auto":
            budget, auto = self.auto_budget(method, method_options)
        if not isinstance(budget, int) or budget < 0:
            raise SpecgraftError(f"budget must be an integer >= 0 or 'auto', got {budget!r}")
        is_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        ids = list(prompt) if is_ids else self.encode(prompt, chat)
        if not ids:
            raise SpecgraftError("empty prompt")
        need = len(ids) + max_new_tokens + budget + 1
        if need > self.backend.max_positions:
            raise SpecgraftError(f"prompt too long: {len(ids)} tokens + {max_new_tokens} new (+ {budget + 1} tree "
                                 f"slots) exceeds the model's {self.backend.max_positions} positions")
        # A drafter's own ``model`` option (the draft model) is recorded as ``draft_model``: ``model`` is the target.
        options = {**{k: v for k, v in DEFAULTS[method].items() if k != "budget"},
                   **{k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in method_options.items()}}
        config = {"model": self.model_name, "dtype": self.dtype, "method": method, "budget": budget,
                  **{("draft_model" if k == "model" else k): v for k, v in options.items()},
                  "sampling": sampling.to_dict(), "max_new_tokens": max_new_tokens, "chat": chat,
                  "stop": list(stop), "verify": rule.spec, "lossy": rule.lossy,
                  **({"budget_auto": auto} if auto else {})}
        stream = Stream(iter(()))
        if drafter is None:
            if stop:
                raise SpecgraftError("hf_assisted does not support stop strings")
            stream._pieces = self._reference_pieces(stream, ids, sampling, max_new_tokens, config, **method_options)
            return stream
        stream._pieces = self._pieces(stream, ids, drafter, sampling, max_new_tokens, budget, stop, config, rule)
        return stream

    def _pieces(self, stream: Stream, ids, drafter, sampling, max_new_tokens, budget, stop, config, rule):
        stats = Stats(method=drafter.name, verify=rule.spec)
        gen = make_generator(sampling.seed)
        out: list[int] = []
        text = full = ""
        t0 = time.perf_counter()
        steps = decode_tokens(self.backend, drafter, ids, sampling, max_new_tokens, budget, self.eos_ids,
                              stats, gen, rule if rule.lossy else None)
        # Hold back the last (longest stop - 1) characters: a stop string may straddle two steps.
        hold = max((len(x) for x in stop), default=1) - 1
        for new in steps:
            out.extend(new)
            full = self.tokenizer.decode(out, skip_special_tokens=True)
            hit = min((full.find(x) for x in stop if x in full), default=-1)
            if hit >= 0:
                out = self._trim_to_stop(out, stop)
                full = full[:hit]
            ready = len(full) if hit >= 0 else len(full) - hold
            if ready > len(text) and not full[:ready].endswith("\ufffd"):  # hold back incomplete UTF-8
                yield full[len(text):ready]
                text = full[:ready]
            if hit >= 0:
                steps.close()
                break
        else:
            if len(full) > len(text):
                yield full[len(text):]
                text = full
        stats.total_s = time.perf_counter() - t0
        described = drafter.describe()
        stats.retrieval_state = described.get("retrieval_state")
        config = {**config, "drafter": described}
        stream.result = Generation(text, out, ids, stats, config)

    def _reference_pieces(self, stream: Stream, ids, sampling, max_new_tokens, config, model=None):
        from .reference import hf_assisted

        out, stats = hf_assisted(self, ids, sampling, max_new_tokens, model or DEFAULTS["hf_assisted"]["model"])
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        yield text
        stream.result = Generation(text, out, ids, stats, {**config, "drafter": {"method": "hf_assisted"}})

    def _trim_to_stop(self, out: list[int], stop) -> list[int]:
        """Shortest token prefix whose text contains a stop string (a step may overshoot it)."""
        for n in range(1, len(out) + 1):
            if any(s in self.tokenizer.decode(out[:n], skip_special_tokens=True) for s in stop):
                return out[:n]
        return out

    def generate(self, prompt: str | list[int], method: str = "ar", **kwargs) -> Generation:
        stream = self.stream(prompt, method, **kwargs)
        for _ in stream:
            pass
        return stream.result


_ENGINES: dict[tuple, Engine] = {}


def generate(prompt: str, model: str = "smollm2-135m", method: str = "ar", dtype: str = "float32",
             **kwargs) -> Generation:
    """One-call API; the engine (model load) is cached per ``(model, dtype)`` within the process."""
    key = (model, dtype)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(model, dtype)
    return _ENGINES[key].generate(prompt, method, **kwargs)
