"""The drafter protocol: every method, AR included, is a drafter that the one engine loop drives.

The engine keeps one prototype per method and options and gives every request its own :meth:`Drafter.fork`
(sharing weights, and retrieval state only where the method's scope says so). Per request it calls
``start`` once (after prefill), then per step ``propose`` (a tree within the node budget) and ``observe``
(the target's logits at every node of that tree, and the verdict). Retrieval state (Token Recycling's and
Graft's matrix) lives behind ``observe``; the loop never knows which drafter it runs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Generator, Protocol

import torch

from .sampling import SamplingParams
from .tree import Tree
from .verify import Verdict


@dataclass(frozen=True)
class DraftContext:
    ids: list[int]  # committed tokens, prompt included; ids[-1] is the root of the next tree
    budget: int  # maximum number of non-root nodes the tree may have
    sampling: SamplingParams = SamplingParams()  # a drafter that samples must use the same processing


def last_occurrences(ids: list[int]) -> list[int]:
    """Positions of the last occurrence of each distinct token, ascending (the last position is always one)."""
    return sorted({t: i for i, t in enumerate(ids)}.values())


class Drafter(Protocol):
    name: str
    # Whether ``start`` wants prefill logits: the rows at the last occurrence of each distinct prompt token
    # (``last_occurrences``; all an adjacency matrix keeps), not every position, because an
    # lm_head over a long prompt's every position costs as much as a large part of the prefill. Even so ``start``
    # may get None: a request joining a batch where the scheduler gives it no tree starts cold (engine.py).
    needs_prefill_logits: bool

    # Target hidden-state layers the drafter reads at prefill and at every verified node (EAGLE heads).
    hidden_layers: tuple[int, ...]
    # Seconds spent in the drafter's own model forwards (EAGLE head, draft model): the engine separates them
    # from host-side work when it measures a step.
    forward_s: float

    def fork(self) -> "Drafter":
        """A fresh drafter for one request: same weights and settings, its own per-request state."""
        ...

    def start(self, prompt_ids: list[int], prefill_logits: torch.Tensor | None,
              prefill_hidden: dict[int, torch.Tensor] | None = None) -> None: ...

    def propose(self, ctx: DraftContext) -> Tree: ...

    def observe(self, tree: Tree, logits: torch.Tensor, verdict: Verdict,
                hidden: dict[int, torch.Tensor] | None = None) -> None: ...

    def describe(self) -> dict:
        """Configuration and state for records: method parameters, retrieval scope and state."""
        ...


def release(drafter: "Drafter") -> None:
    """A request is over (finished, failed or aborted): a drafter that holds shared per-request resources (a
    row of a draft model's shared cache) declares ``release()`` and frees them here."""
    free = getattr(drafter, "release", None)
    if free is not None:
        free()


class Work(Protocol):
    """One unit of a drafter's model work (an EAGLE head pass over some rows) handed out so that several
    requests' units run in ONE forward: units sharing a ``runner`` run together, ``runner.run(units)`` returning
    one result per unit, in order. ``weight`` (optional, default 1): its share of a batched run's time."""

    runner: Any


# A drafter that batches declares ``propose_steps(ctx)``: a generator that yields Work, is sent each result,
# and returns the tree (``Generator[Work, result, Tree]``). ``propose`` stays the one-request path.
ProposeSteps = Generator[Work, Any, Tree]


def steps_of(drafter: "Drafter", ctx: DraftContext) -> ProposeSteps:
    """The drafter's proposal as steps: its own ``propose_steps`` if it declares one, else ``propose`` run whole
    (no model work handed out)."""
    steps = getattr(drafter, "propose_steps", None)
    if steps is not None:
        return steps(ctx)
    return _whole(drafter, ctx)


def _whole(drafter: "Drafter", ctx: DraftContext) -> ProposeSteps:
    return drafter.propose(ctx)
    yield  # a generator that hands out no work


def drive(steps: Generator[Work, Any, Any]):
    """Run one request's steps alone: each unit by its runner, one at a time. Returns the generator's value."""
    result = None
    while True:
        try:
            work = steps.send(result)
        except StopIteration as stop:
            return stop.value
        result = work.runner.run([work])[0]
        if isinstance(result, Exception):  # a runner reports a unit's failure as its result
            raise result


def drive_all(all_steps: list[ProposeSteps]) -> tuple[list[Any], list[float]]:
    """Run many requests' steps in lockstep: each round, every pending unit of one runner goes into one
    ``runner.run`` call (ragged rows, whatever level each request is at). Returns, per request, its tree or
    the exception that ended it (one request's failure never ends another's), and the seconds it spent: its
    own host work plus its share (by ``weight``) of each batched run it took part in.

    A batched run that raises is retried unit by unit, so only the units that fail alone fail."""
    n = len(all_steps)
    out: list[Any] = [None] * n
    spent = [0.0] * n
    pending: dict[int, Work] = {}

    def advance(i: int, value) -> None:
        start = time.perf_counter()
        try:
            pending[i] = all_steps[i].send(value)
        except StopIteration as stop:
            out[i] = stop.value
        except Exception as err:  # noqa: BLE001 -- this request's drafter failed; the others go on
            out[i] = err
        spent[i] += time.perf_counter() - start

    for i in range(n):
        advance(i, None)
    while pending:
        groups: dict[int, list[int]] = defaultdict(list)
        for i, work in pending.items():
            groups[id(work.runner)].append(i)
        current, pending = pending, {}
        for members in groups.values():
            units = [current[i] for i in members]
            start = time.perf_counter()
            try:
                results = units[0].runner.run(units)
                if len(results) != len(units):
                    raise RuntimeError(f"{type(units[0].runner).__name__} returned {len(results)} results for "
                                       f"{len(units)} units")
            except Exception:  # noqa: BLE001 -- find which unit fails: run each alone
                results = []
                for unit in units:
                    try:
                        (alone,) = unit.runner.run([unit])
                        results.append(alone)
                    except Exception as err:  # noqa: BLE001
                        results.append(err)
            elapsed = time.perf_counter() - start
            weights = [getattr(u, "weight", 1) for u in units]
            for i, result, w in zip(members, results, weights):
                spent[i] += elapsed * w / sum(weights)
                if isinstance(result, Exception):
                    out[i] = result
                    all_steps[i].close()
                else:
                    advance(i, result)
    return out, spent


class NoDraft:
    """Plain autoregressive decoding: the tree is the root alone, so each step commits one token."""

    name = "ar"
    needs_prefill_logits = False
    hidden_layers = ()
    forward_s = 0.0

    def fork(self) -> "NoDraft":
        return self

    def start(self, prompt_ids, prefill_logits, prefill_hidden=None) -> None:
        pass

    def propose(self, ctx: DraftContext) -> Tree:
        return Tree.chain(ctx.ids[-1], [])

    def observe(self, tree, logits, verdict, hidden=None) -> None:
        pass

    def describe(self) -> dict:
        return {"method": self.name}
