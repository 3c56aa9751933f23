"""core.drafter's lockstep driver: units of one runner run together, a failure ends only its own request,
drafters without steps run whole."""

import pytest

from specgraft.core.drafter import DraftContext, NoDraft, drive, drive_all, steps_of


class Doubler:
    """A runner that doubles numbers; it refuses 13 (a unit that fails) and records each call's units."""

    def __init__(self):
        self.calls = []

    def run(self, units):
        self.calls.append([u.value for u in units])
        if any(u.value == 13 for u in units):
            raise ValueError("13")
        return [2 * u.value for u in units]


class Unit:
    def __init__(self, runner, value):
        self.runner, self.value = runner, value


def rounds(runner, start, n):
    """Hands out ``n`` units, each the previous result plus one; returns the last result."""
    value = start
    for _ in range(n):
        value = (yield Unit(runner, value)) + 1
    return value


def test_units_of_one_runner_run_together_round_by_round():
    a, b = Doubler(), Doubler()
    out, spent = drive_all([rounds(a, 1, 3), rounds(a, 2, 1), rounds(b, 5, 2)])
    assert out == [drive(rounds(Doubler(), 1, 3)), drive(rounds(Doubler(), 2, 1)), drive(rounds(Doubler(), 5, 2))]
    assert out == [15, 5, 23]
    assert a.calls == [[1, 2], [3], [7]] and b.calls == [[5], [11]]
    assert len(spent) == 3


def test_a_failing_unit_ends_its_own_request_only():
    r = Doubler()
    out, _ = drive_all([rounds(r, 1, 3), rounds(r, 13, 2), rounds(r, 4, 2)])
    assert out[0] == 15 and out[2] == 19
    assert isinstance(out[1], ValueError)
    assert r.calls[:4] == [[1, 13, 4], [1], [13], [4]]  # the batch failed: each unit retried alone


def test_a_drafter_raising_between_units_ends_its_own_request_only():
    def broken(runner):
        yield Unit(runner, 1)
        raise RuntimeError("drafter bug")

    r = Doubler()
    out, _ = drive_all([broken(r), rounds(r, 3, 2)])
    assert isinstance(out[0], RuntimeError) and out[1] == 15


def test_drafters_without_steps_run_whole():
    ctx = DraftContext([4, 5, 6], 3)
    steps = steps_of(NoDraft(), ctx)
    with pytest.raises(StopIteration) as stop:
        next(steps)
    assert stop.value.value.tokens.tolist() == [6]


def test_a_runner_returning_too_few_results_fails_no_request_silently():
    class Short(Doubler):
        def run(self, units):
            return super().run(units)[:1]  # drops all but the first

    r = Short()
    out, _ = drive_all([rounds(r, 1, 1), rounds(r, 2, 1)])
    assert out == [3, 5]  # the short batch was retried unit by unit
