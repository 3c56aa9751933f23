"""Per-request text: stop strings across steps, the streaming hold-back, incomplete characters."""

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
