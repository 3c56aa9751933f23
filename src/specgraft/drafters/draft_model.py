"""A smaller LM with the same tokenizer drafts a chain of ``gamma`` tokens, one forward per token.

Greedy decoding drafts the argmax chain (verified by matching). Under sampling it draws each token from
``q`` = the draft's distribution after the *same* processing as the target's and passes ``q`` along, so
the loop verifies with chain speculative sampling (``min(1, p/q)``, residual ``(p - q)+``).

The draft keeps its own KV cache of the committed prefix (a second backend of the target's kind: transformers or
llama.cpp): each step
first feeds the tokens it has not seen (the accepted ones and the new root), then drafts; ``observe``
rolls the cache back to what the target accepted, so nothing is recomputed that is still valid::

    draft cache:  [ prefix | a1 a2 ]        drafted: d1 d2 d3 d4 (d4 never fed)
    target accepts d1 d2, bonus b  ->  cache rolled back to [ prefix | a1 a2 d1 d2 ], next feed: [ b ]

In our words, with the worked examples the tests assert: docs/design.md §4.3.
"""

from __future__ import annotations

import copy
import time
import weakref
from dataclasses import dataclass
from typing import Any, Generator

import torch

from ..core.backend import Backend, TargetBackend
from .dynamic_tree import Candidates, Gate, Pool, candidates_tree, expand_topk_steps
from ..core.sampling import make_generator, target_probs
from ..core.tree import SOURCE_DRAFT, Tree, path_to
from ..core.drafter import DraftContext, ProposeSteps, drive
from ..errors import SpecgraftError


@dataclass
class Feed:
    """One unit of draft-model work (``core.drafter.Work``): feed ``tokens`` (the request's unfed committed
    tokens, or its last drafted one) to ``drafter``'s cache; the result is the last token's logits ``[V]``."""

    runner: Any
    drafter: "DraftModelDrafter"
    tokens: list[int]

    @property
    def weight(self) -> int:
        return len(self.tokens)

    def run_alone(self) -> torch.Tensor:
        return self.drafter.feed_alone(self.tokens)


@dataclass
class Extend:
    """One level of a draft-model tree (``core.drafter.Work``): append the frontier's ``n`` nodes as speculative
    positions (``Backend.extend``'s arguments); the result is their logits ``[n, V]``."""

    runner: Any
    drafter: "DraftModelDrafter"
    tokens: torch.Tensor  # [n]
    positions: torch.Tensor  # [n]
    visible: torch.Tensor  # bool [n, A + n]: the row's A earlier speculative nodes, then the new ones

    @property
    def weight(self) -> int:
        return int(self.tokens.shape[0])

    def run_alone(self) -> torch.Tensor:
        return self.drafter.extend_alone(self.tokens, self.positions, self.visible)


class OwnCache:
    """The runner of drafters with a cache of their own (a transformers draft model): one forward per unit. A
    unit that fails returns its exception, so the others (already run) are never run twice."""

    @staticmethod
    def run(units: list[Feed | Extend]) -> list[torch.Tensor | Exception]:
        out: list[torch.Tensor | Exception] = []
        for u in units:
            try:
                out.append(u.run_alone())
            except Exception as err:  # noqa: BLE001 -- that request's drafter failed alone
                out.append(err)
        return out


OWN_CACHE = OwnCache()


class _Context:
    """One draft-model context of a :class:`SharedCache` and the drafters whose rows it holds (weakly)."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.rows: list[weakref.ref] = []

    def prune(self) -> None:
        for i in reversed(range(len(self.rows))):
            if self.rows[i]() is None:
                self.backend.remove(i)
                del self.rows[i]

    def index(self, drafter: "DraftModelDrafter") -> int | None:
        return next((i for i, ref in enumerate(self.rows) if ref() is drafter), None)


class SharedCache:
    """Draft-model contexts whose rows are the requests in flight (a backend that declares ``row_feeds``:
    llama.cpp): each lockstep round, every request's feed (a chain token, a tree's root) goes into one decode
    per context, and every request's tree level into another, so B requests' draft work costs about one forward
    instead of B (docs/design.md §4.3)::

        row 0: [ prompt a ... | a1 a2 ]  <- feed [b]          one decode: [b] at row 0, [y1 y2 c] at row 1
        row 1: [ prompt b ........... ]  <- feed [y1 y2 c]

    A row holds ``ids_per_row`` sequence ids at most (its home and ballast, and one per tree node it drafts): a
    context takes rows while their ids fit, and a new context is opened beside it when they do not.
    Rows hold weak references to their drafters: a fork that is never released (a request dropped without
    finishing) loses its row at the next join or run, not later."""

    def __init__(self, backend: Backend, ids_per_row: int = 2):
        self.source = backend  # contexts are clones: nothing else resets or feeds their rows
        self.ids_per_row = ids_per_row
        self.contexts: list[_Context] = []

    def _prune(self) -> None:
        for c in self.contexts:
            c.prune()

    def row(self, drafter: "DraftModelDrafter") -> tuple[_Context, int]:
        for c in self.contexts:
            i = c.index(drafter)
            if i is not None:
                return c, i
        raise SpecgraftError("this draft-model drafter holds no row of its shared cache (released, or never started)")

    def join(self, drafter: "DraftModelDrafter", prompt_ids: list[int]) -> None:
        if any(c.index(drafter) is not None for c in self.contexts):
            raise SpecgraftError("a draft-model drafter instance serves one request at a time: fork it per request")
        self._prune()
        ctx = next((c for c in self.contexts
                    if (len(c.rows) + 1) * self.ids_per_row <= c.backend.capacity()["seq_ids"]), None)
        if ctx is None:
            ctx = _Context(self.source.clone())
            self.contexts.append(ctx)
        ctx.backend.add(torch.tensor(prompt_ids, dtype=torch.long))
        ctx.rows.append(weakref.ref(drafter))

    def leave(self, drafter: "DraftModelDrafter") -> None:
        for c in self.contexts:
            i = c.index(drafter)
            if i is not None:
                c.backend.remove(i)
                del c.rows[i]

    def truncate(self, drafter: "DraftModelDrafter", length: int) -> None:
        c, i = self.row(drafter)
        c.backend.truncate_row(i, length)

    def run(self, units: list[Feed | Extend]) -> list[torch.Tensor | Exception]:
        """Per context, its feeds in one decode and its tree levels in another; results in the units' order. A
        decode that fails changes nothing (``feed_rows`` / ``extend_rows`` are all or nothing), so its units are
        retried one by one here and only those that fail alone return their exception: none runs twice."""
        self._prune()
        where = [self.row(u.drafter) for u in units]
        out: list[torch.Tensor | Exception | None] = [None] * len(units)
        for c in self.contexts:
            for kind in (Feed, Extend):
                idx = [j for j, (cj, _) in enumerate(where) if cj is c and isinstance(units[j], kind)]
                if not idx:
                    continue
                try:
                    got = _run_rows(c.backend, [units[j] for j in idx], [where[j][1] for j in idx])
                except Exception:  # noqa: BLE001 -- find which unit fails: run each alone
                    got = []
                    for j in idx:
                        try:
                            got += _run_rows(c.backend, [units[j]], [where[j][1]])
                        except Exception as err:  # noqa: BLE001
                            got.append(err)
                for j, result in zip(idx, got):
                    out[j] = result
        return out


def _run_rows(backend: Backend, units: list[Feed | Extend], rows: list[int]) -> list[torch.Tensor]:
    """Units of one kind on ``rows`` of one context in one decode; each drafter is charged its share by weight."""
    start = time.perf_counter()
    if isinstance(units[0], Feed):
        got = list(backend.feed_rows(rows, [u.tokens for u in units]))
    else:
        got = backend.extend_rows(rows, [u.tokens for u in units], [u.positions for u in units],
                                  [u.visible for u in units])
    elapsed = time.perf_counter() - start
    total = sum(u.weight for u in units)
    for u in units:
        u.drafter.forwards += 1
        u.drafter.forward_s += elapsed * u.weight / total
    return got


class _Levels:
    """The candidates a draft tree has generated (``expand_topk_steps``' pool) and the slots of those fed
    as speculative positions: what each level's ``Extend`` needs (tokens, positions, visibility)."""

    def __init__(self, tokens: list[int], parents: list[int], base: int):
        self.tokens, self.parents, self.base = tokens, parents, base
        self.fed: dict[int, int] = {}  # candidate index -> its slot among the row's speculative positions

    def nodes(self, frontier: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        slots = [len(self.fed) + j for j in range(len(frontier))]
        visible = torch.zeros(len(frontier), len(self.fed) + len(frontier), dtype=torch.bool)
        depth = []
        for j, f in enumerate(frontier):
            path = path_to(self.parents, f)  # f's speculative ancestors, then f itself
            visible[j, slots[j]] = True
            visible[j, [self.fed[a] for a in path[:-1]]] = True
            depth.append(len(path))
        for j, f in enumerate(frontier):
            self.fed[f] = slots[j]
        # The root (the last committed token) sits at position base - 1, so a node at depth d (root's children:
        # d = 1) sits at base + d - 1, as in the chain path.
        return torch.tensor([self.tokens[f] for f in frontier]), torch.tensor(depth) + self.base - 1, visible


class DraftModelDrafter:
    name = "draft"
    needs_prefill_logits = False
    hidden_layers = ()

    def __init__(self, model: torch.nn.Module | Backend, label: str = "custom", shape: str = "chain", top_k: int = 8,
                 depth: int = 5):
        if shape not in ("chain", "tree"):
            raise ValueError(f"draft shape must be 'chain' or 'tree', got {shape!r}")
        if not (isinstance(top_k, int) and top_k >= 1 and isinstance(depth, int) and depth >= 0):
            raise ValueError("draft tree needs integer top_k >= 1 and depth >= 0")
        self.backend = TargetBackend(model) if isinstance(model, torch.nn.Module) else model
        self.label, self.shape, self.top_k, self.depth = label, shape, top_k, depth
        # On a backend whose rows can be fed together, requests share its contexts: a row holds its home and
        # ballast ids, and a tree's rows one more per node drafted (top_k per level)
        ids = 2 + (top_k * depth if shape == "tree" else 0)
        self.shared = SharedCache(self.backend, ids) if self.backend.capabilities.row_feeds else None
        self.runner = self.shared or OWN_CACHE
        self.cached = 0  # positions of ctx.ids that the draft cache holds
        self.base = 0  # len(ctx.ids) at the last proposal
        self.drafted = 0
        self.gen: torch.Generator | None = None
        self.forwards = 0
        self.forward_s = 0.0

    def fork(self) -> "DraftModelDrafter":
        c = copy.copy(self)  # shares the draft model; its cache rows and generator are per request
        if self.shared is None:
            c.backend = self.backend.clone()
        c.cached = c.base = c.drafted = c.forwards = 0
        c.gen, c.forward_s = None, 0.0
        return c

    def start(self, prompt_ids, prefill_logits, prefill_hidden=None) -> None:
        t0 = time.perf_counter()
        if self.shared is not None:
            self.shared.join(self, prompt_ids)
        else:
            self.backend.prefill(torch.tensor(prompt_ids, dtype=torch.long))
        self.forward_s += time.perf_counter() - t0
        self.cached = len(prompt_ids)
        self.gen = None

    def release(self) -> None:
        """The request is over: its row of a shared cache is freed (the engine calls this when it finishes)."""
        if self.shared is not None:
            self.shared.leave(self)

    def feed_alone(self, tokens: list[int]) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.backend.verify(Tree.chain(tokens[0], tokens[1:]))
        self.backend.commit(list(range(len(tokens))))
        self.forwards += 1
        self.forward_s += time.perf_counter() - t0
        return out.logits[-1]

    def extend_alone(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.backend.extend(tokens, positions, visible)
        self.forwards += 1
        self.forward_s += time.perf_counter() - t0
        return logits

    def _truncate(self, length: int) -> None:
        if self.shared is not None:
            self.shared.truncate(self, length)
        else:
            self.backend.truncate(length)

    def propose(self, ctx: DraftContext) -> Tree:
        return drive(self.propose_steps(ctx))

    def propose_steps(self, ctx: DraftContext) -> ProposeSteps:
        """Chains hand out their feeds (``Feed``), trees their root feed and levels (``Extend``), so the engine runs
        every request's in one decode of a shared cache."""
        if self.shape == "tree":
            return candidates_tree(ctx, (yield from self.draft_steps(ctx, keep=ctx.budget)), ctx.budget)
        drafts, probs, _ = yield from self.chain_steps(ctx, ctx.budget)
        return Tree.chain(ctx.ids[-1], drafts, SOURCE_DRAFT, draft_probs=probs)

    def chain(self, ctx: DraftContext, gamma: int, tau: float | None = None
              ) -> tuple[list[int], torch.Tensor | None, list[float]]:
        """:meth:`chain_steps` run alone (Graft's tail, calibration)."""
        return drive(self.chain_steps(ctx, gamma, tau))

    def chain_steps(self, ctx: DraftContext, gamma: int, tau: float | None = None
                    ) -> Generator[Feed, torch.Tensor, tuple[list[int], torch.Tensor | None, list[float]]]:
        """Draft up to ``gamma`` tokens; with ``tau``, stop before token i when its *stop statistic*
        ``s_i = prod_{j<i} q_j(y_j) * max q_i`` falls below it (at least one token is kept). ``s_i`` is known
        before ``y_i`` is drawn, so the decision never depends on the token it would propose (under greedy it
        equals the cumulative probability of the would-be token; under sampling it does not).

        Returns the tokens, their ``q`` rows (sampling; row 0 for the root, zeros) and ``s_i`` of every kept
        token (what calibration fits ``tau_tail`` on: the statistic the runtime compares).
        """
        self.base, self.drafted = len(ctx.ids), 0
        if gamma <= 0:
            return [], None, []
        params = ctx.sampling
        if not params.greedy and self.gen is None:
            # The draft's randomness is its own, independent of the verifier's (seeded for reproducibility).
            self.gen = make_generator(None if params.seed is None else params.seed + 7919)
        logits = yield Feed(self.runner, self, ctx.ids[self.cached:])
        drafts, qs, stop_stats, c = [], [], [], 1.0
        for i in range(gamma):
            q = target_probs(logits, params) if not params.greedy else torch.softmax(logits.float(), -1)
            # Decide to stop *before* drawing token i, from the kept prefix and q_i alone: a stop that looked
            # at the drawn token would make what is proposed depend on its own value (not lossless).
            stat = c * float(q.max())
            if tau is not None and drafts and stat < tau:
                break
            x = int(logits.argmax()) if params.greedy else int(torch.multinomial(q, 1, generator=self.gen))
            c *= float(q[x])
            drafts.append(x)
            stop_stats.append(stat)
            if not params.greedy:
                qs.append(q)
            if i < gamma - 1:
                logits = yield Feed(self.runner, self, [x])
        if tau is not None and len(drafts) < gamma:
            self._truncate(self.base + len(drafts) - 1)  # the last kept token was fed; drop it
        self.drafted = len(drafts)
        self.cached = self.base + len(drafts) - 1
        probs = None
        if qs:
            probs = torch.cat([torch.zeros_like(qs[0]).unsqueeze(0), torch.stack(qs)])
        return drafts, probs, stop_stats

    def draft(self, ctx: DraftContext, gate: Gate | None = None) -> Candidates | None:
        """:meth:`draft_steps` run alone."""
        return drive(self.draft_steps(ctx, gate))

    def draft_steps(self, ctx: DraftContext, gate: Gate | None = None, keep: int | None = None
                    ) -> Generator[Feed | Extend, torch.Tensor, Candidates | None]:
        """EAGLE-2-style dynamic tree from the draft model: beam by cumulative log-prob (``gate`` may stop
        it early; ``keep``: only the best ``keep`` candidates are used, so the frontiers are capped).
        Candidates are deterministic (top-k), so trees are verified with the q = 1 rule. Yields the root's
        feed, then one ``Extend`` per level; the speculative nodes are dropped when it ends."""
        self.base, self.drafted = len(ctx.ids), 0
        root_logits = yield Feed(self.runner, self, ctx.ids[self.cached:])
        self.cached = self.base
        if ctx.budget <= 0:
            return None
        first = torch.log_softmax(root_logits.float(), -1)
        pool = Pool()  # filled by expand_topk_steps; _Levels reads its tokens and parents
        level = _Levels(pool.tokens, pool.parents, self.base)
        steps = expand_topk_steps(first, self.top_k, self.depth, gate, keep, pool)
        logp = None
        try:
            while True:
                try:
                    frontier = steps.send(logp)
                except StopIteration as stop:
                    return stop.value
                logits = yield Extend(self.runner, self, *level.nodes(frontier))
                logp = torch.log_softmax(logits.float(), -1)
        finally:
            self._truncate(self.base)

    def observe(self, tree, logits, verdict, hidden=None) -> None:
        if self.shape == "tree" or self.drafted == 0:
            return  # nothing speculative is cached (trees dropped theirs): the next feed sends what is unfed
        keep = self.base + min(verdict.accept_length, self.drafted - 1)
        self._truncate(keep)
        self.cached = keep

    def describe(self) -> dict:
        d = {"method": self.name, "draft_model": self.label, "shape": self.shape}
        if self.shape == "tree":
            d.update(top_k=self.top_k, depth=self.depth)
        return d
