"""The engine: one step loop for any number of requests (docs/design.md §2).

    add_request -> prefill alone, join the batch cache
    step        -> every active request's drafter proposes a tree
                   -> ONE batched target forward verifies all trees
                   -> each request's rule (lossless, or an opt-in LOSSY one) -> one commit -> each drafter observes
    abort       -> the request leaves, its cache row is freed

A single request is B = 1 of the same code. ``generate`` / ``stream`` / ``bench`` / ``batch`` / ``calibrate``
/ the distortion tool all run on :meth:`Engine.step`; the server's continuous batching calls it directly.
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Callable, Iterator

import torch

from .auto import auto_budget
from .backend_choice import AUTO, choose_backend
from .backends import open_backend, transformers_drafts
from .core.backend import Backend, Capabilities, TargetBackend
from .core.drafter import DraftContext, Drafter, drive_all, last_occurrences, release, steps_of
from .core.sampling import SamplingParams, make_generator
from .core.stats import Stats
from .core.tree import Tree
from .errors import SpecgraftError
from .lossy.rules import Rule, parse_rule
from .models import resolve_device, resolve_dtype
from .outputs import _LABEL, TOKEN_SOURCES, Generation, RequestOutput, Stream  # noqa: F401 -- re-exported
from .reference import assistant, reference_stream
from .registry import DEFAULTS, REFERENCES, check_lossy, check_options, make_drafter, method_options
from .request import (NoCapacity, Request, check_length, check_reservation, cut_at_eos,  # noqa: F401 -- re-exported
                      first_token, fits, held, verify_fn)
from .text import TextState, chat_ids

clock = time.perf_counter
MAX_DRAFTERS = 16  # cached drafter prototypes (one per method and option set): a bound, not a working-set guess
BACKLOG = 4096  # other requests' outputs kept while one stream drives the engine (oldest dropped beyond it)


class Engine:
    """A loaded target, cached drafters and the requests in flight. ``Engine("smollm2-135m")`` or
    ``Engine.from_model(m, tok)``."""

    def __init__(self, model: str = "smollm2-135m", dtype: str = "float32", cache_dir: str | None = None,
                 backend: str = "transformers", device: str = "cpu"):
        """``backend="llamacpp"`` runs the GGUF itself on llama.cpp (``dtype`` is then the GGUF's own: "gguf").
        ``device`` (transformers): cpu, cuda or auto; the target and a draft model run there, the drafters'
        bookkeeping, EAGLE heads and verification on the CPU."""
        device = resolve_device(device)  # a bad device fails before any model loads
        if backend == AUTO:  # the backend and weights predicted fastest here (backend_choice.py scores dtype auto)
            choice, opened = choose_backend(model, dtype, cache_dir, device)
            self._setup(*opened, model)
            self.backend_choice = choice
            return
        dtype = resolve_dtype(dtype, device)  # "auto": this machine's dtype, known before any curve or cache key
        self._setup(*open_backend(backend, model, dtype, cache_dir, device), model)

    @classmethod
    def from_model(cls, hf_model, tokenizer, name: str = "custom") -> "Engine":
        """An engine on an already loaded HF model (draft models by name load at its dtype and device)."""
        self = cls.__new__(cls)
        params = next(hf_model.parameters())
        dtype = str(params.dtype).replace("torch.", "")
        self._setup(TargetBackend(hf_model, transformers_drafts(dtype, None, str(params.device))), tokenizer, name)
        return self

    @classmethod
    def from_backend(cls, backend: Backend, tokenizer, name: str = "custom") -> "Engine":
        """An engine on any backend that keeps the ``Backend`` protocol."""
        self = cls.__new__(cls)
        self._setup(backend, tokenizer, name)
        return self

    def _setup(self, backend: Backend, tok, name: str) -> None:
        self.backend = backend
        self.backend_choice = None  # --backend auto's choice and its table, when it chose
        self.tokenizer, self.model_name = tok, name
        self.vocab_size = backend.vocab_size
        tok_eos = getattr(tok, "eos_token_id", None)
        self.eos_ids = {*backend.eos_ids, *([tok_eos] if tok_eos is not None else [])}
        # drafter prototypes by (method, options), least recently used first; and builds that failed (a
        # draft model that cannot load is not retried on every request)
        self._drafters: collections.OrderedDict[tuple, Drafter] = collections.OrderedDict()
        self._drafter_errors: dict[tuple, Exception] = {}
        self._auto: dict[tuple, tuple[int, dict]] = {}
        self.active: list[Request] = []  # in cache-row order
        self._done: list[RequestOutput] = []  # outputs produced between steps (prefill, abort)
        self._ids = itertools.count()
        # other requests' outputs met while driving one stream (bounded: nobody may be reading them)
        self.backlog: collections.deque[RequestOutput] = collections.deque(maxlen=BACKLOG)
        self.totals = Stats("engine")  # engine-wide: steps, target forward, drafting, step wall time
        # The scheduler's say (serve/policy.py): (request, batch size) -> this step's budget, at most the request's.
        self.budget_policy: Callable[[Request, int], int] | None = None
        # Drafters on one model (an EAGLE head) draft the whole batch in one forward per round; False drafts
        # each request alone, one after another (the pre-issue-27 path, kept for measuring the difference).
        self.batch_drafts = True
        # A sampled request's tree decides which random draws it consumes, and a batched head pass can round
        # differently from a lone one (another matrix shape), so a sampled request drafts alone: a seeded
        # request's text is then the same whatever runs beside it. False batches it too (its distribution is
        # still exactly the target's; its text may depend on its neighbours). Greedy output never depends on it.
        self.batch_invariant = True

    # -- what the backend declares --------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return self.backend.capabilities

    @property
    def backend_name(self) -> str:
        return self.backend.capabilities.name

    @property
    def device(self) -> str:
        return self.backend.capabilities.device

    @property
    def dtype(self) -> str:
        """The target's weights format: "float32", "bfloat16", or "gguf" (llama.cpp runs the GGUF's own)."""
        return self.backend.capabilities.weights

    # -- set-up -------------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[dict], chat: bool = True) -> list[int]:
        """A user message, or a whole conversation (``[{"role", "content"}, ...]``), as prompt token ids."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not messages or not all(isinstance(m.get("content"), str) for m in messages) \
                or not messages[-1]["content"].strip():
            raise SpecgraftError("empty prompt")
        return chat_ids(self.tokenizer, messages, chat, add_generation_prompt=True)

    def drafter(self, method: str, **options) -> Drafter | None:
        """The cached prototype for ``method`` and ``options``; every request runs a :meth:`fork` of it."""
        options.pop("budget", None)
        if method in REFERENCES:  # not a drafter: check now, run the library's own loop later
            check_options(method, options)
            if method not in self.capabilities.references:
                raise SpecgraftError(f"{method} is an outside reference that runs on --backend "
                                     f"{REFERENCES[method]} only")
            if method == "hf_assisted":  # load (and check) the assistant now
                assistant(options.get("model", DEFAULTS[method]["model"]), self.dtype, self.vocab_size, self.device)
            return None
        key = (method, tuple(sorted(options.items())))
        if key in self._drafter_errors:
            raise self._drafter_errors[key]
        if key not in self._drafters:
            try:
                built = make_drafter(method, self.vocab_size, self.dtype, target_name=self.model_name,
                                     device=self.device, backend=self.backend, **options)
            except Exception as err:
                if len(self._drafter_errors) < MAX_DRAFTERS:
                    self._drafter_errors[key] = err
                raise
            self._drafters[key] = built
            while len(self._drafters) > MAX_DRAFTERS:
                self._drafters.popitem(last=False)  # running requests hold forks, not the prototype
        self._drafters.move_to_end(key)
        return self._drafters[key]

    def auto_budget(self, method: str, options: dict) -> tuple[int, dict]:
        """``budget="auto"``: resolved once per method and options (``auto.auto_budget``), then cached."""
        key = ("auto", method, tuple(sorted((k, str(v)) for k, v in options.items())))
        if key not in self._auto:
            self._auto[key] = auto_budget(self, method, options)
        return self._auto[key]

    def _prepare(self, prompt, method: str, sampling: SamplingParams | None, max_new_tokens: int, stop, chat: bool,
                 budget, verify, drafter: Drafter | None, options: dict) -> Request:
        """Validate everything and build the request (nothing runs yet): errors raise here."""
        sampling = sampling or SamplingParams()
        if drafter is not None and method == "ar":
            method = drafter.name  # a drafter instance: its rules are checked under its own name
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SpecgraftError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        rule = parse_rule(verify)
        if rule.lossy:
            check_lossy(rule, method, options, sampling)
        if drafter is None:
            drafter = self.drafter(method, **options)
            if drafter is None:
                raise SpecgraftError(f"{method} runs its library's own loop: use Engine.generate or stream")
            drafter = drafter.fork()
        budget = DEFAULTS.get(method, {"budget": 0})["budget"] if budget is None else budget
        auto = None
        if budget == "auto":
            budget, auto = self.auto_budget(method, options)
        if not isinstance(budget, int) or budget < 0:
            raise SpecgraftError(f"budget must be an integer >= 0 or 'auto', got {budget!r}")
        is_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        ids = list(prompt) if is_ids else self.encode(prompt, chat)
        check_length(ids, max_new_tokens, budget, self.backend.max_positions)
        reserve = self.backend.reservation(len(ids), max_new_tokens, budget)
        check_reservation(reserve, self.backend.capacity())
        config = self._config(method, options, budget, sampling, max_new_tokens, chat, stop, rule, auto)
        detok = TextState(self.tokenizer, tuple(stop)) if self.tokenizer is not None else None
        return Request(next(self._ids), ids, drafter, sampling, max_new_tokens, budget, verify_fn(rule),
                       Stats(method=drafter.name, verify=rule.spec), config, detok, reserve=reserve)

    def _config(self, method, options, budget, sampling, max_new_tokens, chat, stop, rule, auto) -> dict:
        # A drafter's own ``model`` option (the draft model) is recorded as ``draft_model``: ``model`` is the target.
        opts = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
                for k, v in method_options(method, options).items()}
        return {"model": self.model_name, "dtype": self.dtype, "backend": self.backend_name, "device": self.device,
                "method": method,
                "budget": budget,
                **{("draft_model" if k == "model" else k): v for k, v in opts.items()},
                "sampling": sampling.to_dict(), "max_new_tokens": max_new_tokens, "chat": chat,
                "stop": list(stop), "verify": rule.spec, "lossy": rule.lossy,
                **({"budget_auto": auto} if auto else {})}

    # -- the request API ----------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[dict] | list[int], method: str = "ar", *,
                    sampling: SamplingParams | None = None, max_new_tokens: int = 128, stop: tuple[str, ...] = (),
                    chat: bool = True, budget: int | str | None = None, verify: str | Rule = "lossless",
                    drafter: Drafter | None = None, on_verify: Callable[[Tree, torch.Tensor], None] | None = None,
                    **options) -> int:
        """Validate, prefill and join the batch; returns the request id. The first token (from the prefill)
        comes out of the next :meth:`step`. ``drafter``: run this drafter instance instead of ``method``'s
        (calibration's recorder); ``on_verify(tree, logits)`` sees every verification (the distortion tool)."""
        req = self._prepare(prompt, method, sampling, max_new_tokens, stop, chat, budget, verify, drafter, options)
        req.on_verify = on_verify
        self._admit(req)
        return req.id

    def reserved(self) -> dict[str, int]:
        """Backend resources held by the requests in flight (each holds its worst case from admission on)."""
        return held(self.active)

    def fits(self, reserve: dict[str, int]) -> bool:
        """Whether a request needing ``reserve`` fits beside those in flight (Backend.capacity)."""
        return fits(reserve, self.reserved(), self.backend.capacity())

    def _admit(self, req: Request) -> None:
        """Prefill and join, all or nothing: on any error the row is gone and only this request fails."""
        if not self.fits(req.reserve):
            raise NoCapacity(f"request {req.id} needs {req.reserve}; in flight hold {self.reserved()} of "
                             f"{self.backend.capacity()}", req.reserve)
        req.admitted_at = clock()
        d = req.drafter
        warm = d.needs_prefill_logits and self._drafts_on_joining(req)
        rows = torch.tensor(last_occurrences(req.prompt_ids)) if warm else False
        pre = self.backend.add(torch.tensor(req.prompt_ids, dtype=torch.long), rows, d.hidden_layers)
        self.active.append(req)
        first: list[RequestOutput] = []
        try:
            d.start(req.prompt_ids, pre.logits if warm else None, pre.hidden)
            req.gen = make_generator(req.params.seed)
            tok = first_token(pre.logits[-1], req.params, req.gen)
            req.stats.prefill_s += clock() - req.admitted_at
            req.ids = [*req.prompt_ids]
            self._emit(req, [tok], ["prefill"], first)
        except Exception:  # nothing of it may stay behind for the other requests
            if req in self.active:
                self.backend.remove(self.active.index(req))
                self.active.remove(req)
            release(d)
            raise
        self._done.extend(first)

    def _drafts_on_joining(self, req: Request) -> bool:
        """Whether the scheduler's policy gives ``req`` a tree in the batch it joins. Where it gives none (a
        crowded batch), the prompt is prefilled without the logits a drafter warms its matrix on (Graft, Token
        Recycling): on Qwen2.5-1.5B bf16 they add ~56 ms to a 94-token prefill, which at 16 requests in flight
        the whole batch waits for, 16 times per wave. The drafter starts cold and learns from the tokens it
        verifies once it drafts. Lossless either way."""
        return self.budget_policy is None or self.budget_policy(req, len(self.active) + 1) > 0

    def abort(self, request_id: int) -> bool:
        """Stop a request now and free its cache row; its final output comes out of the next :meth:`step`.
        Returns False when it is not in flight (unknown or already finished)."""
        req = next((r for r in self.active if r.id == request_id), None)
        if req is None:
            return False
        req.finish_reason = "abort"
        self._done.append(self._finish(req))
        return True

    def pending(self) -> list[RequestOutput]:
        """Outputs produced since the last step (first tokens from prefills, aborts), without stepping: a server
        sends a new request's first token as soon as its prefill ends, not with the next step's tokens."""
        outs, self._done = self._done, []
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.active or self._done)

    def step(self) -> list[RequestOutput]:
        """Outputs since the last call (prefills, aborts), then one verification step for every active
        request: propose every tree, ONE batched forward, verify each, one commit, observe. Finished requests
        leave the batch."""
        outs = self.pending()
        if not self.active:
            return outs
        step_start = clock()
        stepped = list(self.active)  # a request failing in this step still counts its draft forwards
        draft_forward_before = [r.drafter.forward_s for r in stepped]
        trees, draft_s = self._propose(outs)
        if not self.active:
            return outs
        forward_start = clock()
        layers = tuple(sorted({h for r in self.active for h in r.drafter.hidden_layers}))
        results = self.backend.verify_batch(trees, layers)
        forward_s = clock() - forward_start
        verdicts = []
        for r, tree, res in zip(self.active, trees, results):
            if r.on_verify is not None:
                r.on_verify(tree, res.logits)
            verdicts.append(r.verify(tree, res.logits, r.params, r.gen))
        self.backend.commit_batch([v.accepted for v in verdicts])
        for r, tree, res, v in zip(list(self.active), trees, results, verdicts):
            draft_s += self._observe(r, tree, res, v, forward_s, outs)
        totals = self.totals
        totals.steps += 1
        totals.verify_s += forward_s
        totals.draft_s += draft_s
        totals.draft_forward_s += sum(r.drafter.forward_s - before for r, before in zip(stepped, draft_forward_before))
        totals.total_s += clock() - step_start
        return outs

    def _propose(self, outs: list[RequestOutput]) -> tuple[list[Tree], float]:
        """Every active request's tree for this step (its budget capped by the scheduler's policy), drafted in
        lockstep so that drafters on one model (an EAGLE head) run ONE forward per round for the whole batch
        (``core.drafter.drive_all``); a request whose drafter raises ends alone. Returns the trees in row order
        and the seconds spent drafting."""
        batch = len(self.active)
        steps = []
        for r in self.active:
            budget = r.budget if self.budget_policy is None else min(r.budget, self.budget_policy(r, batch))
            steps.append(steps_of(r.drafter, DraftContext(r.ids, budget, r.params)))
        proposals, spent = [None] * batch, [0.0] * batch
        shared = [i for i, r in enumerate(self.active)
                  if self.batch_drafts and (r.params.greedy or not self.batch_invariant)]
        groups = [shared] + [[i] for i in sorted(set(range(batch)) - set(shared))]
        for group in groups:  # a sampled request drafts alone (batch invariance, see __init__)
            got, secs = drive_all([steps[i] for i in group])
            for i, p, t in zip(group, got, secs):
                proposals[i], spent[i] = p, t
        trees = []
        for r, proposal, seconds in zip(list(self.active), proposals, spent):
            r.stats.draft_s += seconds
            if isinstance(proposal, Exception):  # one request's drafter failing ends that request only
                self._fail(r, proposal, outs)
            else:
                trees.append(proposal)
        return trees, sum(spent)

    def _observe(self, r: Request, tree: Tree, res, verdict, forward_s: float, outs: list[RequestOutput]) -> float:
        """The drafter learns from the verification; the accepted tokens and the bonus are emitted. Returns the
        seconds the drafter spent observing."""
        observe_start = clock()
        hidden = {h: res.hidden[h] for h in r.drafter.hidden_layers} if r.drafter.hidden_layers else None
        failed = None
        try:
            r.drafter.observe(tree, res.logits, verdict, hidden)
        except Exception as err:  # noqa: BLE001 -- the step's tokens are still correct; the request ends
            failed = err
        observe_s = clock() - observe_start
        r.stats.draft_s += observe_s
        new = cut_at_eos(tree.tokens[verdict.accepted[1:]].tolist() + [verdict.bonus], self.eos_ids, r.room)
        sources = [_LABEL.get(x, "head") for x in tree.source[verdict.accepted[1:]].tolist()] + ["bonus"]
        children = tree.children
        r.stats.record_step(verdict.accept_length, [bool(children[n]) for n in verdict.accepted], len(new),
                            tree.size - 1)
        r.stats.verify_s += forward_s
        self._emit(r, new, sources[: len(new)], outs, tree.size - 1, len(verdict.accepted) - 1)
        if failed is not None and r in self.active:
            self._fail(r, failed, outs)
        return observe_s

    def _fail(self, req: Request, err: Exception, outs: list[RequestOutput]) -> None:
        req.finish_reason = "error"
        final = self._finish(req)
        final.error = f"{type(err).__name__}: {err}"
        outs.append(final)

    def _emit(self, req: Request, new: list[int], sources: list[str], outs: list[RequestOutput], drafted: int = 0,
              accepted: int = 0) -> None:
        """Append a step's tokens; detect EOS, stop strings and length; finished requests leave."""
        req.output.extend(new)
        req.ids.extend(new)
        req.stats.new_tokens += len(new)
        piece = ""
        if new[-1] in self.eos_ids:
            req.finish_reason = "eos"
        elif req.room <= 0:
            req.finish_reason = "length"
        if req.detok is not None:
            piece, hit = req.detok.update(req.output, final=req.finish_reason is not None, sources=sources)
            if hit is not None:
                drop = len(req.output) - hit  # tokens past the stop string, all from this step
                req.output = req.output[:hit]
                req.stats.new_tokens -= drop
                new, sources = new[: len(new) - drop], sources[: len(new) - drop]
                req.finish_reason = "stop"
        segments = req.detok.segments(piece) if piece else []
        if req.finish_reason is None:
            outs.append(RequestOutput(req.id, new, piece, sources=sources, segments=segments, draft_tokens=drafted,
                                      accepted=accepted))
            return
        final = self._finish(req)
        final.token_ids, final.text, final.sources, final.segments = new, piece, sources, segments
        final.draft_tokens, final.accepted = drafted, accepted
        outs.append(final)

    def _finish(self, req: Request) -> RequestOutput:
        self.backend.remove(self.active.index(req))
        self.active.remove(req)
        release(req.drafter)
        req.stats.total_s = clock() - req.admitted_at
        req.stats.draft_forward_s = req.drafter.forward_s
        described = req.drafter.describe()
        req.stats.retrieval_state = described.get("retrieval_state")
        text = req.detok.text if req.detok is not None else ""
        gen = Generation(text, req.output, req.prompt_ids, req.stats, {**req.config, "drafter": described},
                         req.finish_reason or "abort")
        return RequestOutput(req.id, [], "", True, gen)

    def outputs(self) -> Iterator[RequestOutput]:
        """Step until nothing is in flight, yielding every request's outputs as they come."""
        while self.has_unfinished():
            yield from self.step()

    def run(self) -> dict[int, Generation]:
        """Step until every request in flight has finished; their results by request id."""
        return {o.request_id: o.result for o in self.outputs() if o.finished}

    # -- one request at a time: B = 1 of the same loop ------------------------------------------------------
    def stream(self, prompt: str | list[dict] | list[int], method: str = "ar", *, sampling: SamplingParams | None = None,
               max_new_tokens: int = 128, stop: tuple[str, ...] = (), chat: bool = True,
               budget: int | str | None = None, verify: str | Rule = "lossless", **method_options) -> "Stream":
        """Validate everything up front (errors raise here, not mid-stream), then return a lazy text stream.

        ``verify``: ``"lossless"`` (default) or an opt-in LOSSY rule ``"lossy:RULE:PARAM"`` (lossy/rules.py).
        Other requests in flight advance too; their outputs are kept in ``self.backlog``."""
        if method in REFERENCES:
            return reference_stream(self, method, prompt, sampling or SamplingParams(), max_new_tokens, stop, chat,
                                    verify, method_options)
        req = self._prepare(prompt, method, sampling, max_new_tokens, stop, chat, budget, verify, None,
                            method_options)
        stream = Stream(iter(()))
        stream._pieces = self._drive(req, stream)
        return stream

    def _drive(self, req: Request, stream: "Stream") -> Iterator[str]:
        self._admit(req)
        finished = False
        try:
            while not finished:
                for o in self.step():
                    if o.request_id != req.id:
                        self.backlog.append(o)
                        continue
                    if o.finished:
                        finished = True
                        if o.error is not None:  # this request's drafter raised: a bug, not bad input
                            raise RuntimeError(f"request {req.id} failed: {o.error}")
                        stream.result = o.result
                    if o.text:
                        yield o.text
        finally:  # the caller stopped early (break, close, an exception): the request leaves the batch now
            if not finished and self.abort(req.id):
                self._done = [o for o in self._done if o.request_id != req.id]

    def generate(self, prompt: str | list[dict] | list[int], method: str = "ar", **kwargs) -> Generation:
        stream = self.stream(prompt, method, **kwargs)
        for _ in stream:
            pass
        return stream.result


_ENGINES: dict[tuple, Engine] = {}


def generate(prompt: str, model: str = "smollm2-135m", method: str = "ar", dtype: str = "float32",
             backend: str = "transformers", device: str = "cpu", **kwargs) -> Generation:
    """One-call API; the engine (model load) is cached per ``(model, dtype, backend, device)`` in the process."""
    key = (model, dtype if backend == AUTO else resolve_dtype(dtype, resolve_device(device)), backend, device)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(model, dtype, backend=backend, device=device)
    return _ENGINES[key].generate(prompt, method, **kwargs)
