"""What the engine hands back: per-step request outputs, finished generations, and a text stream."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from .core.stats import Stats
from .core.tree import SOURCE_CONTEXT, SOURCE_DRAFT, SOURCE_RETRIEVAL


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: Stats
    config: dict = field(default_factory=dict)
    finish_reason: str = "length"  # eos | stop | length | abort | error

    def to_record(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": len(self.prompt_ids),
                "config": self.config, "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}


# Where each emitted token came from (the playground's colours, the server's by-source metrics): the first
# token comes from the prefill; a step's accepted candidates from the drafter's model (EAGLE head / draft model)
# or from retrieval: the adjacency matrix ("matrix") or a continuation copied from earlier in the sequence
# ("context": prompt lookup, Graft's context source); its last token is the target's bonus token.
TOKEN_SOURCES = ("prefill", "head", "matrix", "context", "bonus")
_LABEL = {SOURCE_DRAFT: "head", SOURCE_RETRIEVAL: "matrix", SOURCE_CONTEXT: "context"}


@dataclass
class RequestOutput:
    """What one step did for one request: its new tokens and text, and the result once it finished.

    ``sources[i]`` labels ``token_ids[i]`` (one of TOKEN_SOURCES). ``draft_tokens`` / ``accepted`` are this step's
    verified candidates and how many of them were accepted (before an EOS or length cut); 0 outside a step.
    ``error`` is set when this request's drafter failed: the request alone ends (finish_reason "error")."""

    request_id: int
    token_ids: list[int]
    text: str
    finished: bool = False
    result: Generation | None = None
    sources: list[str] = field(default_factory=list)
    segments: list[tuple[str, str]] = field(default_factory=list)  # ``text`` as (run, source); "".join == text
    draft_tokens: int = 0
    accepted: int = 0
    error: str | None = None


class Stream:
    """Iterate for text pieces; ``result`` holds the :class:`Generation` once iteration ends."""

    def __init__(self, pieces: Iterator[str]):
        self._pieces = pieces
        self.result: Generation | None = None

    def __iter__(self) -> Iterator[str]:
        yield from self._pieces

    def close(self) -> None:
        """Stop early: a request still running leaves the engine's batch (also on ``with`` exit and GC)."""
        close = getattr(self._pieces, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
