"""One engine thread owns the model; HTTP handlers talk to it through :class:`Ticket` queues.

Each loop turn (docs/serving.md):
    1. aborts: tickets cancelled by their handler (the client went away) or past their deadline
    2. admission: waiting tickets join while fewer than ``max_num_seqs`` run (prefill alone, then a batch row)
    3. one ``Engine.step()``: every running request's tree verified in ONE batched forward
    4. each output goes to its ticket's asyncio queue (``call_soon_threadsafe``), metrics are updated

Requests wait in a bounded queue; beyond it :meth:`Runner.submit` raises :class:`QueueFull` (HTTP 429). Admission
is all or nothing (``Engine._admit``): a request that fails there gets its error alone (400 for bad values, 500
otherwise) and leaves no row behind. A request that fits the model but not beside those running (the backend's
shared KV cells or sequence ids, ``Backend.capacity``) stays first in the queue until enough finish. A step that
raises fails the requests in it (500) and frees their rows, and the loop goes on serving the rest. A drafter
that raises ends only its own request (the engine isolates it). If the loop itself dies, :meth:`Runner.submit`
raises :class:`EngineDead` (HTTP 503) and ``/health`` fails, so a supervisor restarts the process.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..engine import Engine, NoCapacity, RequestOutput
from ..errors import SpecgraftError
from .metrics import Metrics

log = logging.getLogger("specgraft.serve")
clock = time.monotonic


_PATH = re.compile(r"(?<![\w.])(?:/[^\s'\"/:;,()]+){2,}/?")


def scrub(message: str) -> str:
    """An error message for a client: server paths replaced (a client must not probe the file system)."""
    return _PATH.sub("<path>", message)


class QueueFull(Exception):
    pass


class EngineDead(Exception):
    """The engine loop has stopped: nothing would serve a queued request."""


def _malloc_trim():
    """glibc's malloc_trim, or None elsewhere. Requests of every length and batch shape leave freed blocks that
    glibc keeps; without trimming, resident memory creeps up over thousands of requests (docs/serving.md)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


TRIM_EVERY = 200  # finished requests between trims (a trim costs a few milliseconds)


@dataclass(eq=False)
class Ticket:
    """One request between its handler (asyncio) and the engine thread."""

    kwargs: dict  # Engine.add_request arguments
    prompt: Any
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=lambda: clock())  # looked up per call: tests set the runner's clock
    deadline: float | None = None
    request_id: int | None = None  # the engine's, once admitted
    cancelled: bool = False
    timed_out: bool = False
    prompt_tokens: int = 0
    last_t: float | None = None
    need: dict | None = None  # backend resources it waits for (set when it did not fit)
    replica: str = ""  # the serving process (responses name it: Ray tests check who served)
    # --method auto under load: ``fallback`` (AR's kwargs) is admitted instead when ``pays(batch)`` says the
    # request's method gets no tree in a step of that many requests; ``shed`` records that it was
    fallback: dict | None = None
    pays: Callable[[int], bool] | None = None
    shed: bool = False

    def put(self, item) -> None:
        """Hand an output (or ("error", APIError args)) to the handler; safe from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the handler's loop is closed: nobody is listening any more
            pass


class Runner:
    def __init__(self, engine: Engine, metrics: Metrics, max_num_seqs: int = 8, max_queue: int = 128,
                 timeout_s: float | None = 600.0):
        self.engine, self.metrics = engine, metrics
        self.max_num_seqs, self.max_queue, self.timeout_s = max_num_seqs, max_queue, timeout_s
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.running: dict[int, Ticket] = {}
        self.cond = threading.Condition()
        self.stopped = False
        self.error: str | None = None  # set when the loop itself died: /health answers 503
        self.trim, self.finished = _malloc_trim(), 0
        self.turns = 0  # loop turns so far; :meth:`wait_for` wakes on each, and on every admission and submit
        self._admitting: list[Ticket] = []
        self.deferred = 0  # admissions put off because the request did not fit beside the running ones
        self._turn = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="specgraft-engine", daemon=True)

    def start(self) -> "Runner":
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
        self.thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def wait_for(self, predicate, timeout: float = 60.0) -> bool:
        """Block until ``predicate()`` holds after a loop turn (or now); False on timeout. For tests and tools
        that must wait on the server's own state, not on sleeps."""
        with self._turn:
            return self._turn.wait_for(predicate, timeout)

    def _turned(self, turn: bool = True) -> None:
        with self._turn:
            self.turns += turn
            self._turn.notify_all()

    # -- called from handlers (any thread) ----------------------------------------------------------------
    def submit(self, ticket: Ticket) -> None:
        if self.timeout_s:
            ticket.deadline = ticket.arrival + self.timeout_s
        with self.cond:  # the loop sets ``error`` under this lock: no ticket slips in after it died
            if not self.alive:
                raise EngineDead(self.error or "the engine loop is not running")
            free = max(0, self.max_num_seqs - len(self.running))  # joins at the next turn without queueing
            if len(self.waiting) >= self.max_queue + free:
                raise QueueFull
            self.waiting.append(ticket)
            self.metrics.waiting.labels(self.metrics.model_name).set(len(self.waiting))
            self.cond.notify()
        self._turned(turn=False)

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: abort at the next step boundary (a no-op when it already finished)."""
        with self.cond:
            ticket.cancelled = True
            self.cond.notify()

    def retry_after_s(self) -> int:
        """A hint for 429's Retry-After: roughly how long the queue ahead takes to clear."""
        per = self.engine.totals.total_s / max(self.engine.totals.steps, 1)
        return max(1, int(per * 64 * len(self.waiting) / max(self.max_num_seqs, 1)))

    # -- the engine thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self.cond:
                    while not (self.stopped or self.waiting or self.running or self.engine.has_unfinished()):
                        self._turned()  # idle: whoever waits on the server's state sees it settled
                        self.cond.wait()
                    if self.stopped:
                        return
                    self._expire_waiting()
                    admit = self._admitting = []  # popped, not yet running: told too if the loop dies
                    while self.waiting and len(self.running) + len(admit) < self.max_num_seqs:
                        admit.append(self.waiting.popleft())
                self._abort_running()
                for i, t in enumerate(admit):
                    # no room beside the running ones: it and those after it wait
                    if not self._admit(t, len(admit) - i - 1 + len(self.waiting)):
                        with self.cond:
                            self.waiting.extendleft(reversed(admit[i:]))
                        self.deferred += 1
                        break
                self._turned(turn=False)
                self._deliver(self.engine.pending())  # first tokens now: TTFT is the prefill, not + one step
                self._step()
                m = self.metrics
                m.running.labels(m.model_name).set(len(self.engine.active))  # vLLM's meaning: the engine's rows
                m.waiting.labels(m.model_name).set(len(self.waiting))
                self._turned()
        except BaseException as err:  # noqa: BLE001 -- the loop must not die silently
            log.exception("engine loop died")
            with self.cond:
                self.error = f"{type(err).__name__}: {err}"
                told = {id(t) for t in self.running.values()}
                for t in [*self.running.values(), *(t for t in self._admitting if id(t) not in told), *self.waiting]:
                    t.put(("error", 500, "the engine stopped; see the server log", "server_error"))
                self.waiting.clear()
            self._turned()

    def _expire_waiting(self) -> None:
        now, keep = clock(), collections.deque()
        for t in self.waiting:
            if t.cancelled:
                continue
            if t.deadline is not None and now > t.deadline:
                t.timed_out = True
                t.put(("error", 504, f"request timed out after {self.timeout_s:g} s in the queue", "timeout"))
                continue
            keep.append(t)
        self.waiting = keep

    def _abort_running(self) -> None:
        now = clock()
        for t in list(self.running.values()):
            if t.cancelled or (t.deadline is not None and now > t.deadline):
                t.timed_out = not t.cancelled
                self.engine.abort(t.request_id)

    def _admit(self, t: Ticket, queued: int = 0) -> bool:
        """Admit one ticket; False when it must wait for room (nothing changed). Errors end this ticket only.
        ``queued``: tickets still waiting behind it (the batch it joins grows by them, up to ``max_num_seqs``)."""
        if t.cancelled:
            return True
        if t.fallback is not None and t.pays is not None:
            # vLLM's disable-by-batch-size, decided by the budget policy: a tree shrunk to nothing still costs
            # its drafter's work (prefill logits, matrix updates, features), so such a request runs as AR
            shed = not t.pays(min(self.max_num_seqs, len(self.engine.active) + 1 + queued))
            if shed != t.shed:
                t.need = None  # what it waited for was the other choice's reservation
            t.shed = shed
        if t.need is not None and not self.engine.fits(t.need):  # still no room: skip building the request
            return False
        try:
            rid = self.engine.add_request(t.prompt, **(t.fallback if t.shed else t.kwargs))
        except NoCapacity as err:
            t.need = err.need
            return False
        except SpecgraftError as err:
            t.put(("error", 400, scrub(str(err)), "invalid_request_error"))
            return True
        except Exception as err:  # noqa: BLE001 -- e.g. a drafter that cannot load: this request only
            log.exception("admission failed")
            t.put(("error", 500, f"could not start the request ({type(err).__name__})", "server_error"))
            return True
        t.request_id = rid
        if t.shed:
            self.metrics.shed.labels(self.metrics.model_name).inc()
        # the ticket's prompt is token ids (the handler tokenised it); a request that finished during admission
        # (max_tokens 1, a first token that is EOS or hits a stop string) has already left the engine's rows
        t.prompt_tokens = len(t.prompt)
        self.metrics.prompt_tokens.labels(self.metrics.model_name).inc(t.prompt_tokens)
        self.running[rid] = t
        return True

    def _step(self) -> None:
        if not self.engine.has_unfinished():
            return
        try:
            outs = self.engine.step()
        except Exception:  # noqa: BLE001 -- a failed batched forward: fail its requests, keep serving
            log.exception("engine step failed")
            for rid, t in list(self.running.items()):
                t.put(("error", 500, "the engine failed on this batch; see the server log", "server_error"))
                self.engine.abort(rid)
            for r in list(self.engine.active):  # rows nobody waits for (a library caller's) go too
                self.engine.abort(r.id)
            self.engine.pending()  # drops the aborts' outputs without stepping again
            self.running.clear()
            return
        self._deliver(outs)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            t = self.running.get(o.request_id)
            if t is None:
                continue
            self._account(t, o)
            t.put(o)
            if o.finished:
                del self.running[o.request_id]
                self.finished += 1
                if self.trim is not None and self.finished % TRIM_EVERY == 0:
                    self.trim(0)

    def _account(self, t: Ticket, o: RequestOutput) -> None:
        m, now = self.metrics, clock()
        if t.last_t is None and o.token_ids:
            m.ttft.labels(m.model_name).observe(now - t.arrival)
        if o.token_ids:
            m.tokens(len(o.token_ids), None if t.last_t is None else now - t.last_t)
            t.last_t = now
        m.step(o.draft_tokens, o.accepted, o.sources)
        if o.finished:
            reason = "abort" if t.timed_out or t.cancelled else o.result.finish_reason
            m.success.labels(m.model_name, reason).inc()
            m.e2e.labels(m.model_name).observe(now - t.arrival)
