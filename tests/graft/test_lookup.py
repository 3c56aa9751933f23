"""PLD sized by the cost curve (graft/lookup.py): golden lengths, estimates past the table, the request record,
and greedy equality through the engine (tiny model; SmolLM2 in tests/test_smollm2.py and on llama.cpp in
tests/backends/test_llamacpp.py)."""

import pytest

from specgraft.core.drafter import DraftContext
from specgraft.core.verify import Verdict
from specgraft.errors import SpecgraftError
from specgraft.graft.context import PRIOR_CONTINUE, PRIOR_FIRST, ContextModel, Match
from specgraft.graft.lookup import CostSizedLookup, best_length, chain_values
from specgraft.registry import make_drafter


def flat(width):  # a memory-bound forward: any width costs one token's time
    return 1.0


def steep(width):  # each extra token costs half a one-token forward
    return 1.0 + 0.5 * (width - 1)


def test_best_length_golden():
    gains = [0.9, 0.8, 0.7]
    # flat: every token is free, take all the budget allows
    assert best_length(gains, flat, 3) == 3 and best_length(gains, flat, 2) == 2
    # steep: rates 1/1, 1.9/1.5 = 1.267, 2.7/2 = 1.35, 3.4/2.5 = 1.36 -> 3; without the last gain's 0.7 -> 2
    assert best_length(gains, steep, 3) == 3
    assert best_length([0.9, 0.8, 0.2], steep, 3) == 2  # 2.9/2.5 = 1.16 < 1.35
    # linear from zero (cost = width): no estimate below 1 ever pays; a tie keeps the shorter tree
    assert best_length(gains, lambda w: float(w), 3) == 0
    assert best_length([1.0], lambda w: float(w), 1) == 0
    assert best_length([], flat, 5) == 0 and best_length(gains, flat, 0) == 0


def test_chain_values_continue_geometrically_past_the_table():
    model = ContextModel.prior()
    long = Match(start=0, length=20, tokens=tuple(range(24)))  # bucket 16+
    vals = chain_values(model, long)
    assert len(vals) == 24
    assert vals[0] == pytest.approx(PRIOR_FIRST[-1]) and vals[15] == pytest.approx(PRIOR_FIRST[-1] * PRIOR_CONTINUE ** 15)
    assert vals[20] == pytest.approx(PRIOR_FIRST[-1] * PRIOR_CONTINUE ** 20)  # not flat past DEPTH = 16
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    assert chain_values(model, long, factor=0.5)[0] == pytest.approx(PRIOR_FIRST[-1] * 0.5)


# a 30-token segment seen before: the suffix matches it 30 tokens back (bucket 16+, prior 0.9 * 0.85^j)
COPY = list(range(100, 140)) + list(range(100, 130))
# only the last token occurred before (bucket 1: prior 0.25)
WEAK = [5, 6, 7, 8, 9, 5]


def test_steep_curve_drafts_long_copies_and_nothing_on_weak_matches():
    d = CostSizedLookup(steep)
    assert d.propose(DraftContext(WEAK, budget=16)).size == 1  # 1.25 / 1.5 < 1: an AR step
    tree = d.propose(DraftContext(COPY, budget=16))
    # the continuation 130, 131, ... with the prior's 0.9, 0.765, 0.650: rates 1.9/1.5 = 1.267,
    # 2.665/2 = 1.3325, 3.315/2.5 = 1.326 -> two nodes
    assert tree.tokens.tolist() == [129, 130, 131] and tree.parent_list == [-1, 0, 1]
    assert d.counters["drafting_steps"] == 1 and d.counters["steps"] == 2
    # flat: the whole continuation the budget allows
    assert CostSizedLookup(flat).propose(DraftContext(COPY, budget=8)).tokens.tolist() == list(range(129, 138))
    assert CostSizedLookup(flat).propose(DraftContext(COPY, budget=0)).size == 1


def test_rejections_lower_the_request_estimates_and_fork_forgets_them():
    def cost(width):
        return 1.0 + 0.7 * (width - 1)

    d = CostSizedLookup(flat)
    tree = d.propose(DraftContext(COPY, budget=4))
    assert tree.size == 5
    d.observe(tree, None, Verdict([0], bonus=7))  # nothing accepted
    expected = sum(chain_values(d.model, Match(0, 30, (0, 1, 2, 3))))  # 0.9 + 0.765 + 0.650 + 0.553
    assert d._record == {"accepted": 0.0, "expected": pytest.approx(expected)}
    # a fresh request drafts on this curve (1.9 / 1.7 > 1); this one now scales its estimates by
    # 4 / (2.868 + 4) = 0.582, and 1 + 0.524 < 1.7: an AR step
    d.cost = cost
    assert CostSizedLookup(cost).propose(DraftContext(COPY, budget=4)).size > 1
    assert d.propose(DraftContext(COPY, budget=4)).size == 1
    assert d.fork()._record == {"accepted": 0.0, "expected": 0.0}
    d.observe(tree, None, Verdict([0, 1, 2], bonus=7))
    assert d._record["accepted"] == 2 and d.counters["accepted"] == 2


def test_several_continuations_form_a_trie():
    ids = [1, 2, 3, 10, 11, 1, 2, 3, 20, 21, 9, 1, 2, 3]  # "1 2 3" was followed by 10 and by 20
    tree = CostSizedLookup(flat).propose(DraftContext(ids, budget=4))
    assert sorted(tree.tokens.tolist()[1:]) == [10, 11, 20, 21]
    assert tree.parent_list.count(0) == 2  # two branches under the root
    one = CostSizedLookup(flat, chains=1).propose(DraftContext(ids, budget=4))
    assert one.parent_list == [-1, 0, 1, 2, 3]  # the most recent continuation only


def test_registry_options():
    with pytest.raises(SpecgraftError, match="engine"):
        make_drafter("pld", 16, length="cost")  # no backend: no measured curve
    with pytest.raises(SpecgraftError, match="budget or cost"):
        make_drafter("pld", 16, length="fast")
    with pytest.raises(SpecgraftError, match="chains"):
        make_drafter("pld", 16, chains=2)
    assert make_drafter("pld", 16).describe() == {"method": "pld", "max_ngram": 3}  # plain PLD unchanged


def test_greedy_equal_to_ar_through_the_engine(tiny_engine):
    """On the tiny engine's repetitive outputs cost-sized lookup drafts and is accepted, and every output is AR's."""
    drafted = 0
    for prompt in ("Tell me a story.", "List the numbers."):
        ref = tiny_engine.generate(prompt, "ar", max_new_tokens=60)
        out = tiny_engine.generate(prompt, "pld", max_new_tokens=60, length="cost", budget=16)
        assert out.token_ids == ref.token_ids, prompt
        drafted += out.stats.steps < len(out.token_ids)
        assert out.to_record()["config"]["drafter"]["length"] == "cost"
    assert drafted >= 1
