"""Per-request text: stop strings across steps, the streaming hold-back, incomplete characters; incremental
decoding against whole-output decoding on real tokenizers, and its cost."""

import random

import pytest

from specgraft.text import TextState


class CharTokenizer:
    """Token i is the i-th character of ``alphabet``; 99 is half of a multi-byte character."""

    def __init__(self, alphabet: str):
        self.alphabet = alphabet

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\ufffd" if i == 99 else self.alphabet[i] for i in ids)


def test_stop_string_straddling_two_steps_is_cut_and_never_streamed():
    tok = CharTokenizer("abcdEND")
    state = TextState(tok, ("END",))
    out, pieces = [0, 1, 2], []
    piece, hit = state.update(out)
    pieces.append(piece)
    assert hit is None and piece == "a"  # "bc" held back: it could start a stop string (len 3 - 1)
    out += [3, 4]  # "d" + "E"
    piece, hit = state.update(out)
    pieces.append(piece)
    assert hit is None and "E" not in piece
    out += [5, 6, 0]  # "ND" completes the stop string, then one more token in the same step
    piece, hit = state.update(out)
    pieces.append(piece)
    assert hit == 7  # the shortest token prefix whose text contains "END"
    assert "".join(pieces) == state.text == "abcd"


def test_incomplete_characters_are_held_until_complete_or_final():
    state = TextState(CharTokenizer("xy"), ())
    piece, _ = state.update([0, 99])
    assert piece == ""  # ends inside a character: wait for the rest
    piece, _ = state.update([0, 1])
    assert piece == "xy"
    piece, _ = state.update([0, 1, 99], final=True)
    assert piece == "\ufffd" and state.text == "xy\ufffd"  # the end flushes whatever is left


def test_segments_split_each_piece_by_token_source_across_held_back_text():
    state = TextState(CharTokenizer("abcdef"), ("ff",))  # holds back one character
    out = [0, 1, 2]
    piece, _ = state.update(out, sources=["prefill", "head", "bonus"])
    assert piece == "ab" and state.segments(piece) == [("a", "prefill"), ("b", "head")]
    out += [3, 4]
    piece, _ = state.update(out, sources=["matrix", "bonus"])
    assert piece == "cd" and state.segments(piece) == [("c", "bonus"), ("d", "matrix")]
    piece, _ = state.update(out, final=True, sources=[])
    assert state.segments(piece) == [("e", "bonus")]


# --- incremental decoding against whole-output decoding on real tokenizers -----------------------------------

SNIPPETS = ["héllo wörld", " naïve café", "😀🎉👍🏽", " 👩‍👩‍👧 family", "世界你好，東京。", " Ελληνικά", " a . b , c ' s",
            "\n\n```python\nprint('x')\n```\n", " don't", "ﬁ²∑√", " 123.45"]


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    from specgraft import models

    spec = models.REGISTRY[name]
    if any(models.package_file(req.split("==")[0], spec.suffix) is None for req in spec.packages):
        pytest.skip(f"{name} is not installed ({spec.install_hint})")
    cached = models.cache_root() / "models" / name
    if name != "smollm2-135m" and not (cached / "config.json").exists():
        cached = models.gguf_file(name)[1]  # the tokenizer alone: no dequantisation of a large model
    return AutoTokenizer.from_pretrained(models.resolve(name) if name == "smollm2-135m" else cached)


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def real_tokenizer(request):
    return _tokenizer(request.param)


def stream(tok, ids: list[int], sizes: list[int], stop: tuple[str, ...]):
    """Feed ``ids`` to a TextState as the engine does (``sizes`` tokens a step, cycled; the last step final, a
    stop string ends it): the pieces, the hit, and each step's end. Segments must rebuild each piece."""
    state, out, pieces, bounds, k = TextState(tok, stop), [], [], [], 0
    while len(out) < len(ids):
        new = ids[len(out): len(out) + sizes[k % len(sizes)]]
        out, k = out + new, k + 1
        bounds.append(len(out))
        piece, hit = state.update(out, final=len(out) == len(ids), sources=[f"s{(len(out) + i) % 3}" for i in
                                                                           range(len(new))])
        pieces.append(piece)
        assert not piece or "".join(t for t, _ in state.segments(piece)) == piece
        if hit is not None:
            return pieces, hit, bounds, state
    return pieces, None, bounds, state


def reference(tok, ids: list[int], bounds: list[int], stop: tuple[str, ...]):
    """Brute force: the first step whose whole decode holds a stop string; its text cut there, and the shortest
    token prefix whose decode holds one."""
    def dec(x):
        return tok.decode(x, skip_special_tokens=True)

    for b in bounds:
        text = dec(ids[:b])
        if found := [text.find(s) for s in stop if s in text]:
            return text[:min(found)], next(n for n in range(1, b + 1) if any(s in dec(ids[:n]) for s in stop))
    return dec(ids), None


def check(tok, ids, sizes, stop):
    pieces, hit, bounds, state = stream(tok, ids, sizes, stop)
    text, keep = reference(tok, ids, bounds, stop)
    assert "".join(pieces) == state.text == text
    assert hit == keep
    if hit is not None:  # the engine drops only tokens of the step that hit
        assert hit > (bounds[-2] if len(bounds) > 1 else 0)


def stops_in(tok, ids, bounds, rnd: random.Random) -> tuple[str, ...]:
    """Stop strings from the decoded text: one anywhere, one straddling a step boundary, one never there."""
    text = tok.decode(ids, skip_special_tokens=True)
    picks = []
    if text:
        a = rnd.randrange(len(text))
        picks.append(text[a: a + rnd.randint(1, 6)])
        at = len(tok.decode(ids[:rnd.choice(bounds)], skip_special_tokens=True))
        picks.append(text[max(0, at - rnd.randint(1, 3)): at + rnd.randint(1, 3)])
    picks = [s for s in picks if s and "\ufffd" not in s]  # a stop string is whole characters
    return tuple(rnd.sample(picks, rnd.randint(0, len(picks)))) + (("\x00never",) if rnd.random() < 0.5 else ())


def _cases(tok, kind: str, seed: int):
    rnd = random.Random(seed)
    if kind == "vocab":  # any ids, special tokens and lone bytes of multi-byte characters included
        ids = [rnd.randrange(len(tok)) for _ in range(rnd.randint(1, 80))]
    else:  # real text split into byte-level tokens
        ids = tok.encode("".join(rnd.choices(SNIPPETS, k=rnd.randint(1, 6))), add_special_tokens=False)
    sizes = [rnd.randint(1, 8) for _ in range(rnd.randint(1, 5))]
    bounds, k = [], 0
    while not bounds or bounds[-1] < len(ids):
        bounds, k = bounds + [min(len(ids), (bounds[-1] if bounds else 0) + sizes[k % len(sizes)])], k + 1
    return ids, sizes, stops_in(tok, ids, bounds, rnd)


try:
    from hypothesis import given, settings, strategies as st
except ImportError:  # seeded random instead
    given = None


@pytest.mark.parametrize("kind", ["vocab", "text"])
def test_pieces_and_hit_equal_whole_output_decoding(real_tokenizer, kind):
    if given is None:
        for seed in range(60):
            check(real_tokenizer, *_cases(real_tokenizer, kind, seed))
        return

    @settings(derandomize=True, max_examples=60, deadline=None, database=None)
    @given(st.integers(0, 2 ** 32))
    def run(seed):
        check(real_tokenizer, *_cases(real_tokenizer, kind, seed))

    run()


def test_unicode_text_in_every_step_size(real_tokenizer):
    """Each snippet alone, in steps of 1..8 tokens, with a stop string straddling each step boundary."""
    for text in SNIPPETS:
        ids = real_tokenizer.encode(text, add_special_tokens=False)
        whole = real_tokenizer.decode(ids, skip_special_tokens=True)
        for size in range(1, 9):
            check(real_tokenizer, ids, [size], ())
            for b in range(size, len(ids), size):
                at = len(real_tokenizer.decode(ids[:b], skip_special_tokens=True))
                stop = whole[max(0, at - 1): at + 1]
                if len(stop) == 2 and "\ufffd" not in stop:
                    check(real_tokenizer, ids, [size], (stop,))


def test_clean_up_tokenization_spaces_decodes_whole_and_streams_only_what_stays():
    """The clean-up deletes spaces steps after they were decoded (" ." -> "."): window decodes would not add up
    to the whole decode, so such a tokenizer decodes the whole output and streams only text no rule can change."""
    from transformers import AutoTokenizer

    from specgraft import models
    from specgraft.text import _cleans_up

    path = models.resolve("smollm2-135m")
    assert not _cleans_up(AutoTokenizer.from_pretrained(path))
    assert not _cleans_up(AutoTokenizer.from_pretrained(path, clean_up_tokenization_spaces=True))  # BPE: ignored
    tok = AutoTokenizer.from_pretrained(path, clean_up_tokenization_spaces=True,
                                        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    assert _cleans_up(tok)
    ids = tok.encode("it 's a . b , c ' d we 're", add_special_tokens=False)
    assert tok.decode(ids) == "it's a. b, c'd we're"
    for size in range(1, 5):
        for stop in [(), ("a.",), ("b,",), ("'d",)]:
            check(tok, ids, [size], stop)
    rnd = random.Random(0)
    for _ in range(40):
        text = "".join(rnd.choices(SNIPPETS + [" x .", " it 's", " we 're", " ' ", "  ,"], k=rnd.randint(1, 8)))
        ids = tok.encode(text, add_special_tokens=False)
        check(tok, ids, [rnd.randint(1, 8)], ())


class CountingTokenizer:
    """Counts the token ids decoded."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def test_decoding_cost_is_linear_in_the_output():
    """2,000 tokens fed 1-4 a step with a stop string at the end: O(n) ids decoded (re-decoding the whole output
    every step, and every prefix at the hit, decoded ~2.8M)."""
    tok = _tokenizer("smollm2-135m")
    body = tok.encode(" ".join(SNIPPETS) * 200, add_special_tokens=False)
    ids = body[:1990] + tok.encode(" the STOPHERE end", add_special_tokens=False)
    counting, rnd = CountingTokenizer(tok), random.Random(0)
    state, out = TextState(counting, ("STOPHERE",)), []
    while True:
        new = ids[len(out): len(out) + rnd.randint(1, 4)]
        out = out + new
        piece, hit = state.update(out, sources=["head"] * len(new))
        if hit is not None:
            break
    assert hit == next(n for n in range(len(out), 0, -1) if "STOPHERE" not in tok.decode(ids[:n - 1]))
    assert state.text == tok.decode(ids[:hit]).split("STOPHERE")[0]
    assert counting.decoded < 30 * len(out), counting.decoded
