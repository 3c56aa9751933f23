"""The scheduler's budget policy (serve/policy.py): golden choices on synthetic latency curves."""

from types import SimpleNamespace

from specgraft.serve.policy import BatchBudget, batch_budget, knee, verify_s

FLAT_THEN_LINEAR = {1: 0.10, 2: 0.10, 4: 0.10, 8: 0.11, 16: 0.12, 32: 0.20, 64: 0.40}
# Every step accepts the nodes of score rank 0, 1 and 3: MAT(K) = 1 + #ranks below K.
RANKS = [[0, 1, 3]] * 10


# llama.cpp-like: its x86 GEMM runs on blocks of 4 rows, so 3 rows cost more than 4 (issue 26's Intel curve)
BLOCKED = {1: 0.080, 2: 0.116, 3: 0.148, 4: 0.131, 5: 0.200, 6: 0.210, 7: 0.220, 8: 0.180, 16: 0.300}


def test_extrapolation_and_knee():
    assert verify_s(FLAT_THEN_LINEAR, 128) == 0.80 and verify_s(FLAT_THEN_LINEAR, 24) == 0.16
    assert knee(FLAT_THEN_LINEAR) == 16 and knee({1: 0.1, 2: 0.2}) == 1


def test_trees_land_on_the_end_of_a_cheap_block():
    """Ranks 0 and 1 accepted: MAT(K) = 1 + min(K, 2). A 3-row forward is dearer than a 4-row one on the blocked
    curve, so alone K = 3 (4 rows) beats K = 2 (3 rows) at the same MAT; two requests fill 8 rows (K = 3), the
    next cheap block, rather than 6."""
    ranks = [[0, 1]] * 10
    assert batch_budget(BLOCKED, ranks, 0.0, 9, 1) == 3
    assert batch_budget(BLOCKED, ranks, 0.0, 9, 2) == 3
    assert batch_budget(BLOCKED, ranks, 0.0, 2, 1) == 2  # never above the request's budget


def test_budget_shrinks_as_the_batch_grows():
    # Alone, K = 4 reaches all three accepted ranks (MAT 4) while the forward is still nearly flat. At B = 8,
    # K = 2 (MAT 3, 24 slots, 0.16 s: 150 tok/s) beats K = 4 (MAT 4, 40 slots, 0.25 s: 128 tok/s); when the
    # forward is compute-bound (B = 64) extra slots buy nothing and ties go to the smaller tree.
    got = {b: batch_budget(FLAT_THEN_LINEAR, RANKS, 0.0, 59, b) for b in (1, 2, 4, 8, 16, 64)}
    assert got == {1: 4, 2: 4, 4: 4, 8: 2, 16: 1, 64: 0}
    # A costly drafter is paid at every K, so it does not push the choice to K = 0 by itself.
    assert batch_budget(FLAT_THEN_LINEAR, RANKS, 0.05, 59, 4) == got[4]
    assert batch_budget(FLAT_THEN_LINEAR, RANKS, 0.0, 1, 1) == 1  # never above the request's budget
    # A drafter idle at K = 0 (an EAGLE head defers its features) makes K = 0 cost AR's step: under load a
    # costly head is then dropped, where a drafter paid at every K keeps its tree.
    assert batch_budget(FLAT_THEN_LINEAR, RANKS, 0.01, 59, 16) == 2
    assert batch_budget(FLAT_THEN_LINEAR, RANKS, 0.01, 59, 16, idle_at_zero=True) == 0


def test_policy_keeps_lone_and_sampled_budgets_and_uses_the_knee_without_calibration():
    policy = BatchBudget.__new__(BatchBudget)
    policy.curve, policy.knee, policy.model, policy._cal, policy._memo = FLAT_THEN_LINEAR, 16, "m", {}, {}
    greedy, sampled = SimpleNamespace(greedy=True), SimpleNamespace(greedy=False)
    pld = SimpleNamespace(budget=10, config={"method": "pld"}, params=greedy)
    assert [policy(pld, b) for b in (1, 2, 4, 8, 16)] == [10, 7, 3, 1, 0]
    pld.params = sampled  # a seeded request's text must not depend on its neighbours: its tree stays
    assert [policy(pld, b) for b in (1, 4, 16)] == [10, 10, 10]
    policy._cal[("graft", "eagle", None, None)] = (RANKS, 0.0, True)
    graft = SimpleNamespace(budget=59, config={"method": "graft", "drafter": "eagle"}, params=greedy)
    assert [policy(graft, b) for b in (1, 8, 64)] == [59, 2, 0]
