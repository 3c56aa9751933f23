"""The cost curve's cache: a curve measured while other processes took the CPUs is used but never cached."""

import json
import os
from types import SimpleNamespace

import pytest

from specgraft import costs
from specgraft.core.backend import Capabilities


def test_snapshot_counts_busy_time_with_steal_and_without_idle_or_iowait(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 10 50 1000 20 5 5 30 7 0\ncpu0 50 5 25 500 10 2 3 15 3 0\n")
    wall, busy, own = costs.cpu_snapshot(stat)
    assert busy == pytest.approx((100 + 10 + 50 + 5 + 5 + 30) / os.sysconf("SC_CLK_TCK"))
    assert own >= 0 and wall > 0


def test_snapshot_is_none_without_proc_stat(tmp_path):
    assert costs.cpu_snapshot(tmp_path / "absent") is None
    (tmp_path / "garbled").write_text("cpu x y\n")
    assert costs.cpu_snapshot(tmp_path / "garbled") is None


def test_others_share_is_the_machine_time_this_process_did_not_use():
    assert costs.others_share((0.0, 0.0, 0.0), (2.0, 3.0, 1.0), cpus=2) == pytest.approx(0.5)
    assert costs.others_share((0.0, 0.0, 0.0), (2.0, 1.0, 1.0), cpus=2) == 0.0  # only us
    assert costs.others_share((0.0, 5.0, 0.0), (2.0, 4.0, 1.0), cpus=2) == 0.0  # never negative
    assert costs.others_share(None, (2.0, 1.0, 1.0)) is None
    assert costs.others_share((2.0, 0.0, 0.0), (2.0, 1.0, 1.0)) is None  # no time passed


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
        cpus = os.cpu_count() or 1
        for _ in range(100):  # (wall, machine busy, own): we ran 1 s, others share * wall * cpus
            yield 0.0, 0.0, 0.0
            yield 1.0, 1.0 + state.share * cpus, 1.0

    feed = snapshots()
    monkeypatch.setattr(costs, "measure_curve", measure)
    monkeypatch.setattr(costs, "cpu_snapshot", lambda: next(feed))
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
    costs.backend_curve("m", FakeBackend())  # the next run measures again
    assert measured.calls == ["float32", "float32"]
    measured.share = 0.0
    costs.backend_curve("m", FakeBackend())
    assert costs.backend_curve_path("m", FakeBackend.capabilities).exists()
