"""Per-request text: incremental detokenisation, stop strings and the streaming hold-back.

A step may commit several tokens, and a stop string may straddle two steps, so the last
``len(longest stop) - 1`` characters are held back until the next step (or the end) shows they are not the
start of a stop string; a piece that ends inside a multi-byte character (``\\ufffd``) is held back too.

Each token's source (engine.TOKEN_SOURCES) is kept with the character offset where its text ends, so any
emitted piece splits into runs of one source each (:meth:`TextState.segments`): the playground and
``generate --compare`` colour text by where each token came from, even across held-back characters.

Decoding is incremental (as vLLM's detokenizer), so a step costs O(its tokens + the previous step's), not
O(output): the new tokens are decoded behind the previous step's, and the difference is the new text. That
equals the whole decode because the window starts and the known text ends on whole characters (the offsets only
advance when the text does not end in ``\ufffd``), and a decoder's start-of-window effects hit both decodes.
"""

from __future__ import annotations

import bisect


CLEANUP_CHARS = frozenset(" .?!,'nmtsvre")  # every character transformers' clean_up_tokenization reads


def _cleans_up(tokenizer) -> bool:
    """Whether decode applies clean_up_tokenization_spaces. That rewrites text across any boundary (" ." -> ".",
    the space maybe decoded steps ago), so window decodes would not add up to the whole decode. Transformers 5
    skips it for BPE tokenizers (the registry's) even when the flag is set: ask the tokenizer."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    try:
        ids = tokenizer.encode("a .", add_special_tokens=False)
        return tokenizer.decode(ids) != tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    except (AttributeError, TypeError):
        return True


class TextState:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(x) for x in stop), default=1) - 1
        self.full = ""  # the text of every token so far (cut at a stop string)
        self.text = ""  # what was emitted
        self.sources: list[str] = []  # per output token
        self.ends: list[int] = []  # per output token: len(decode(output[:i + 1]))
        # Incremental decoding as vLLM's detokenizer: ``_done`` is the text of output[:_read], which ends on a whole
        # character; output[_prefix:_read] (``_context``, the previous step's tokens) is decoded again in front of
        # the new tokens so that whatever a decoder does at a window's start cancels out in the difference.
        self._prefix = self._read = self._seen = 0  # _seen: len(output) at the last update
        self._done = self._context = ""
        self._whole = _cleans_up(tokenizer)  # then the window never advances: whole decodes, as before

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _tail(self, output: list[int], n: int) -> str:
        """The text of output[_read:n] (n >= _read), so that decode(output[:n]) == _done + _tail(output, n)."""
        return self.decode(output[self._prefix: n])[len(self._context):]

    def update(self, output: list[int], final: bool = False, sources: list[str] | None = None
               ) -> tuple[str, int | None]:
        """The new text piece after ``output`` grew, and, when a stop string appeared, the number of tokens to
        keep: the shortest prefix of ``output`` whose text contains it (a step may overshoot it). ``sources``
        labels the new tokens (for :meth:`segments`). Costs O(new tokens + the previous step's), not O(output)."""
        tail = self._tail(output, len(output))
        self.full = self._done + tail
        if sources:
            # Offsets of a step's tokens from a decode of the step's tokens alone (not of the whole output per
            # token, which would cost O(len) per token); the last one is the full text's length, so they resync
            # every step. A character split across the step boundary may be attributed one token off.
            first, base = len(output) - len(sources), self.ends[-1] if self.ends else 0
            for end in [base + len(self.decode(output[first: first + i + 1])) for i in range(len(sources) - 1)] \
                    + [len(self.full)]:
                self.ends.append(max(end, self.ends[-1] if self.ends else 0))
            self.sources.extend(sources)
        # _done was searched before (no stop string in it): one can only end in the tail
        lo = max(0, len(self._done) - max(self.hold, 0))
        found = [(i, s) for i, s in ((self.full.find(s, lo), s) for s in self.stop) if i >= 0]
        if found:
            keep = self._keep(output, lo, min(i + len(s) for i, s in found))
            self.full, self._seen = self.full[:min(i for i, _ in found)], len(output)
            return self.flush(), keep
        if not self._whole and tail and not tail.endswith("\ufffd"):  # else the tail may end inside a character
            self._done, self._prefix, self._read = self.full, self._read, len(output)
            self._context = self.decode(output[self._prefix: self._read])
        self._seen = len(output)
        if final:
            return self.flush(), None
        # A trailing "\ufffd" (a character not yet whole) may become the start of a stop string too; a clean-up
        # may still delete spaces up to the last character that no clean-up rule reads.
        end = len(self.full.rstrip("\ufffd")) if self.hold > 0 else len(self.full)
        while self._whole and end and self.full[end - 1] in CLEANUP_CHARS:
            end -= 1
        ready = end - self.hold
        if ready > len(self.text) and self.full[ready - 1] != "\ufffd":
            piece = self.full[len(self.text): ready]
            self.text += piece
            return piece, None
        return "", None

    def _keep(self, output: list[int], lo: int, first_end: int) -> int:
        """The shortest n with a stop string in decode(output[:n]); it is one of this step's tokens, since the last
        step's text had none. decode(output[:n]) is _done + _tail(output, n), and only its part past ``lo`` can
        hold one, so each test costs a window decode. The candidate is the token where ``ends`` puts the end of the
        first stop string, then walked to the first that holds one (a step or two where a character straddles)."""
        head = self._done[lo:]

        def has(n: int) -> bool:
            text = head + self._tail(output, n)
            return any(s in text for s in self.stop)

        n = bisect.bisect_left(self.ends, first_end) + 1 if len(self.ends) == len(output) else len(output)
        n = min(max(n, self._seen + 1), len(output))
        if not has(n):
            n += 1
            while n < len(output) and not has(n):  # has(len(output)) holds: the stop string is in the tail
                n += 1
            return n
        while n - 1 > self._seen and has(n - 1):
            n -= 1
        return n

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
