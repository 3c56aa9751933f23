"""Per-request text: incremental detokenisation, stop strings and the streaming hold-back.

A step may commit several tokens, and a stop string may straddle two steps, so the last
``len(longest stop) - 1`` characters are held back until the next step (or the end) shows they are not the
start of a stop string; a piece that ends inside a multi-byte character (``\\ufffd``) is held back too.
"""

from __future__ import annotations


class TextState:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(x) for x in stop), default=1) - 1
        self.full = ""  # the text of every token so far (cut at a stop string)
        self.text = ""  # what was emitted

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, output: list[int], final: bool = False) -> tuple[str, int | None]:
        """The new text piece after ``output`` grew, and, when a stop string appeared, the number of tokens to
        keep: the shortest prefix of ``output`` whose text contains it (a step may overshoot it)."""
        self.full = self.decode(output)
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
