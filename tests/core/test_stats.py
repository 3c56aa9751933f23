from specgraft.core.stats import Stats


def test_mat_includes_bonus():
    s = Stats()
    for a in (0, 2, 5):
        s.record_step(a, [True] * (a + 1), a + 1, 10)
    assert abs(s.mat - 10 / 3) < 1e-9
    assert s.steps == 3 and s.tree_nodes == 30


def test_acceptance_per_depth():
    s = Stats()
    s.record_step(0, [True], 1, 4)  # depth-1 trial rejected
    s.record_step(2, [True, True, False], 3, 4)  # depth 1 and 2 accepted; the depth-2 node is a leaf
    s.record_step(1, [True, True], 2, 4)  # depth 1 accepted, depth 2 rejected
    assert s.depth_trials == [3, 2]
    assert s.depth_accepts == [2, 1]
    assert s.acceptance_per_depth == [2 / 3, 1 / 2]
    merged = s.merge(s)
    assert merged.depth_trials == [6, 4] and merged.mat == s.mat and merged.steps == 6
