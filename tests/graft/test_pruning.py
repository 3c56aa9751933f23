"""Pruning gates: where each fires, and that a firing gate stops the expansion (no further draft forward)."""

import math

import pytest
import torch

from specgraft.drafters.dynamic_tree import expand_topk
from specgraft.graft.pruning import DDD, SVIP, SparseGate, make_policy


def test_sparse_gate_checks_only_its_checkpoints():
    gate = SparseGate((0.5, 0.4, 0.3))
    low = torch.log(torch.tensor([0.2, 0.1]))
    assert gate(0, low, low) and gate(1, low, low) and gate(5, low, low)
    assert not any(gate(level, low, low) for level in (2, 3, 4, 6))
    high = torch.log(torch.tensor([0.55, 0.1]))
    assert not gate(0, high, high) and gate(1, torch.log(torch.tensor([0.39])), high)
    assert [gate.stage_of(lvl) for lvl in (0, 1, 5, None)] == [0, 1, 2, None]
    assert gate.stage_from_confidences([0.9, 0.9, 0.8, 0.7, 0.6, 0.2]) == 2
    assert gate.stage_from_confidences([0.9, 0.3, 0.1]) == 1
    assert gate.stage_from_confidences([0.9, 0.9, 0.9]) is None  # level 5 never reached: no stage
    with pytest.raises(ValueError):
        SparseGate((0.5, 1.5, 0.1))


def test_ddd_uses_the_beam_mass_and_svip_the_entropy():
    ddd = DDD()
    mass = torch.log(torch.tensor([0.1, 0.05, 0.04]))  # total 0.19 < 0.2
    assert ddd(2, mass, mass) and not ddd(3, mass, mass)
    assert not ddd(2, torch.log(torch.tensor([0.1, 0.11])), mass)
    svip = SVIP(h=0.8)
    sharp = torch.log(torch.tensor([0.97, 0.01, 0.01, 0.01]))
    flat = torch.log(torch.full((8,), 1 / 8))  # entropy ln 8 = 2.08, sqrt 1.44
    assert not svip(3, sharp, sharp) and svip(3, sharp, flat)
    assert make_policy("ddd", param=math.log(0.5)).h_thr == pytest.approx(math.log(0.5))
    with pytest.raises(ValueError, match="unknown pruning policy"):
        make_policy("nope")


def test_gate_stops_expansion_and_records_the_level():
    calls = []
    v = 6

    def expand(frontier):
        calls.append(len(frontier))
        return torch.log_softmax(torch.arange(len(frontier) * v, dtype=torch.float).reshape(-1, v) % 5, -1)

    first = torch.log_softmax(torch.tensor([2.0, 1.0, 0.5, 0.1, 0.0, -1.0]), -1)
    full = expand_topk(first, expand, 3, 4)
    assert full.stopped_at is None and len(calls) == 4 and len(full.level_best) == 5
    calls.clear()
    stopped = expand_topk(first, expand, 3, 4, gate=lambda level, s, lp: level == 2)
    assert stopped.stopped_at == 2 and len(calls) == 2  # levels 1 and 2 expanded, nothing after
    assert stopped.tokens == full.tokens[: len(stopped.tokens)] and set(stopped.levels) == {0, 1, 2}
    calls.clear()
    at_root = expand_topk(first, expand, 3, 4, gate=SparseGate((0.99, 0.5, 0.5)))
    assert at_root.stopped_at == 0 and calls == [] and len(at_root.tokens) == 3
