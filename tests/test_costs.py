"""The cost curve's cache: a curve measured while other processes took the CPUs is used but never cached."""

import json
import os
from types import SimpleNamespace

import pytest

from specgraft import costs
from specgraft.core.backend import Capabilities


def test_snapshot_counts_busy_time_with_steal_and_without_idle_or_iowait_on_our_cores(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  160 16 80 1600 32 8 8 48 10 0\n"
                    "cpu0 100 10 50 1000 20 5 5 30 7 0\n"
                    "cpu1 60 6 30 600 12 3 3 18 3 0\nintr 12345\n")
    hz = os.sysconf("SC_CLK_TCK")
    wall, busy, own, cores = costs.cpu_snapshot(stat, cpus={0, 1})
    assert busy == pytest.approx((100 + 10 + 50 + 5 + 5 + 30 + 60 + 6 + 30 + 3 + 3 + 18) / hz) and cores == 2
    assert own >= 0 and wall > 0
    _, busy, _, cores = costs.cpu_snapshot(stat, cpus={1})  # a neighbour on core 0 is not ours to count
    assert busy == pytest.approx((60 + 6 + 30 + 3 + 3 + 18) / hz) and cores == 1


def test_snapshot_is_none_without_proc_stat(tmp_path):
    assert costs.cpu_snapshot(tmp_path / "absent") is None
    (tmp_path / "garbled").write_text("cpu0 x y\n")
    assert costs.cpu_snapshot(tmp_path / "garbled", cpus={0}) is None
    (tmp_path / "other").write_text("cpu0 1 2 3 4 5 6 7 8\n")
    assert costs.cpu_snapshot(tmp_path / "other", cpus={5}) is None  # none of our cores listed


def test_others_share_is_the_cores_time_this_process_did_not_use():
    assert costs.others_share((0.0, 0.0, 0.0, 2), (2.0, 3.0, 1.0, 2)) == pytest.approx(0.5)
    assert costs.others_share((0.0, 0.0, 0.0, 2), (2.0, 1.0, 1.0, 2)) == 0.0  # only us
    assert costs.others_share((0.0, 5.0, 0.0, 2), (2.0, 4.0, 1.0, 2)) == 0.0  # never negative
    assert costs.others_share(None, (2.0, 1.0, 1.0, 2)) is None
    assert costs.others_share((2.0, 0.0, 0.0, 2), (2.0, 1.0, 1.0, 2)) is None  # no time passed


class FakeBackend:
    capabilities = Capabilities("fake", "float32", "threads=1")
    vocab_size = 100


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """Counts measurements; ``measured.share`` is what the snapshots around each say others took."""
    monkeypatch.setenv("SPECGRAFT_CACHE", str(tmp_path))
    state = SimpleNamespace(calls=[], share=0.0)

    def measure(backend, vocab_size, widths=costs.WIDTHS, prefix=256, reps=3):
        state.calls.append(backend.capabilities.weights)
        return {w: 0.01 * w for w in widths}

    def snapshots():
        for _ in range(100):  # (wall, our 2 cores busy, own, cores): we ran 1 s, others share * wall * 2
            yield 0.0, 0.0, 0.0, 2
            yield 1.0, 1.0 + state.share * 2, 1.0, 2

    feed = snapshots()
    monkeypatch.setattr(costs, "measure_curve", measure)
    monkeypatch.setattr(costs, "cpu_snapshot", lambda: next(feed))
    monkeypatch.setattr(costs, "_UNCACHED", {})
    return state


def test_a_curve_measured_on_an_idle_machine_is_cached(measured):
    measured.share = 0.02
    curve = costs.backend_curve("m", FakeBackend())
    assert costs.backend_curve("m", FakeBackend()) == curve and measured.calls == ["float32"]
    body = json.loads(costs.backend_curve_path("m", FakeBackend.capabilities).read_text())
    assert body["others_cpu_share"] == pytest.approx(0.02)


def test_a_contended_curve_is_used_but_not_cached(measured, capsys):
    measured.share = 0.5
    curve = costs.backend_curve("m", FakeBackend())
    assert curve[4] == pytest.approx(0.04)  # the run that measured it uses it
    assert not costs.backend_curve_path("m", FakeBackend.capabilities).exists()
    err = capsys.readouterr().err
    assert "50% of this machine's CPU time" in err and "not cached" in err
    assert costs.backend_curve("m", FakeBackend()) == curve  # this process: the same curve, not measured again
    assert measured.calls == ["float32"]
    costs._UNCACHED.clear()  # the next process measures again
    measured.share = 0.0
    costs.backend_curve("m", FakeBackend())
    assert measured.calls == ["float32", "float32"]
    assert costs.backend_curve_path("m", FakeBackend.capabilities).exists()


class DriftingBackend:
    """A backend whose forward at width ``w`` costs ``1 + 0.1 * w`` units on a fake clock, times the machine's
    speed: 1 until forward number ``step_at``, then ``slow`` (a drift from one phase to another)."""

    rows = 0

    def __init__(self, clock, step_at: int, slow: float = 1.6):
        self.clock, self.step_at, self.slow, self.calls = clock, step_at, slow, 0

    def prefill(self, ids):
        pass

    def verify(self, tree):
        self.clock[0] += (1 + 0.1 * tree.size) * (self.slow if self.calls >= self.step_at else 1.0)
        self.calls += 1

    def truncate(self, length):
        pass

    def reset(self):
        pass


@pytest.mark.parametrize("step_at", [5, 40, 71, 100, 133])
def test_a_drift_during_the_measurement_moves_the_whole_curve_not_a_stretch_of_it(monkeypatch, step_at):
    """Timed one width after another, a phase change makes every later width look dearer: a false knee. Timed
    between neighbouring reference forwards, the curve's shape (each width's cost over width 1's) stays exact
    wherever the change falls."""
    clock = [0.0]
    monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])
    widths = tuple(range(1, 21))
    curve = costs.measure_curve(DriftingBackend(clock, step_at), 1000, widths, prefix=8, reps=3)
    for w in widths:
        assert curve[w] / curve[1] == pytest.approx((1 + 0.1 * w) / 1.1)
    # the level: the reference's median, somewhere between the two phases
    assert 1.1 - 1e-9 <= curve[1] <= 1.1 * 1.6 + 1e-9
