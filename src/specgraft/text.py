"""Per-request text: incremental detokenisation, stop strings and the streaming hold-back.

A step may commit several tokens, and a stop string may straddle two steps, so the last
``len(longest stop) - 1`` characters are held back until the next step (or the end) shows they are not the
start of a stop string; a piece that ends inside a multi-byte character (``\\ufffd``) is held back too.

Each token's source (engine.TOKEN_SOURCES) is kept with the character offset where its text ends, so any
emitted piece splits into runs of one source each (:meth:`TextState.segments`): the playground and
``generate --compare`` colour text by where each token came from, even across held-back characters.
"""

from __future__ import annotations

import bisect


class TextState:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(x) for x in stop), default=1) - 1
        self.full = ""  # the text of every token so far (cut at a stop string)
        self.text = ""  # what was emitted
        self.sources: list[str] = []  # per output token
        self.ends: list[int] = []  # per output token: len(decode(output[:i + 1]))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, output: list[int], final: bool = False, sources: list[str] | None = None
               ) -> tuple[str, int | None]:
        """The new text piece after ``output`` grew, and, when a stop string appeared, the number of tokens to
        keep: the shortest prefix of ``output`` whose text contains it (a step may overshoot it). ``sources``
        labels the new tokens (for :meth:`segments`)."""
        self.full = self.decode(output)
        if sources:
            # Offsets of a step's tokens from a decode of the step's tokens alone (not of the whole output per
            # token, which would cost O(len) per token); the last one is the full text's length, so they resync
            # every step. A character split across the step boundary may be attributed one token off.
            first, base = len(output) - len(sources), self.ends[-1] if self.ends else 0
            for end in [base + len(self.decode(output[first: first + i + 1])) for i in range(len(sources) - 1)] \
                    + [len(self.full)]:
                self.ends.append(max(end, self.ends[-1] if self.ends else 0))
            self.sources.extend(sources)
        hit = min((self.full.find(x) for x in self.stop if x in self.full), default=-1)
        if hit >= 0:
            self.full = self.full[:hit]
            keep = next(n for n in range(1, len(output) + 1)
                        if any(s in self.decode(output[:n]) for s in self.stop))
            return self.flush(), keep
        if final:
            return self.flush(), None
        ready = len(self.full) - self.hold
        if ready > len(self.text) and not self.full[:ready].endswith("\ufffd"):
            piece, self.text = self.full[len(self.text): ready], self.full[:ready]
            return piece, None
        return "", None

    def flush(self) -> str:
        piece, self.text = self.full[len(self.text):], self.full
        return piece

    def segments(self, piece: str) -> list[tuple[str, str]]:
        """``piece`` (the text just emitted, the tail of ``self.text``) as ``(text, source)`` runs; their
        concatenation is ``piece``. Characters past the last known token end take the last token's source."""
        start, stop = len(self.text) - len(piece), len(self.text)
        runs: list[tuple[str, str]] = []

        def add(a: int, b: int, src: str) -> None:
            if a < b:
                runs[-1:] = [(runs[-1][0] + self.text[a:b], src)] if runs and runs[-1][1] == src else \
                    [*runs[-1:], (self.text[a:b], src)]

        i = bisect.bisect_right(self.ends, start)  # the first token ending after ``start``: no walk from the start
        lo = self.ends[i - 1] if i else 0
        for src, end in zip(self.sources[i:], self.ends[i:]):
            if lo >= stop:
                break
            add(max(lo, start), min(end, stop), src)
            lo = end
        add(max(lo, start), stop, self.sources[-1] if self.sources else "bonus")
        return runs


def chat_ids(tokenizer, messages: list[dict], chat: bool = True, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation: the chat template when the tokenizer has one, else turns joined by a blank
    line (base models)."""
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer("\n\n".join(m["content"] for m in messages)).input_ids
