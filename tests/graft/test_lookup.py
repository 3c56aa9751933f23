"""PLD sized by the cost curve (graft/lookup.py): golden lengths, estimates past the table, the request record,
and greedy equality through the engine (tiny model; SmolLM2 in tests/test_smollm2.py and on llama.cpp in
tests/backends/test_llamacpp.py)."""

import pytest

from specgraft.core.backend import TargetBackend

from specgraft.core.drafter import DraftContext
from specgraft.core.verify import Verdict
from specgraft.errors import SpecgraftError
from specgraft.graft.context import PRIOR_CONTINUE, PRIOR_FIRST, ContextModel, Match
from specgraft.graft.lookup import AcceptanceRecord, CostSizedLookup, best_length, replay
from specgraft.registry import make_drafter

from ..engine.test_engine import SAMPLING_PARAMS, SAMPLING_PROMPT, exact_ar_joint, sample_counts
from ..conftest import tiny_llama
from ..stattest import N_NEGATIVE, check_loop, with_negative_control


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


def test_record_starts_from_the_table_and_continues_geometrically_past_it():
    rec = AcceptanceRecord(ContextModel.prior())  # prior rows: p * 0.85^j
    assert rec.rates(5) == pytest.approx((PRIOR_FIRST[-1], PRIOR_CONTINUE))
    vals = rec.values(Match(start=0, length=20, tokens=tuple(range(24))))  # bucket 16+
    assert len(vals) == 24
    assert vals[15] == pytest.approx(PRIOR_FIRST[-1] * PRIOR_CONTINUE ** 15)
    assert vals[20] == pytest.approx(PRIOR_FIRST[-1] * PRIOR_CONTINUE ** 20)  # not flat past the table's 16
    table = ((0.8, 0.4) + (0.4,) * 14,)
    assert AcceptanceRecord(ContextModel(table)).rates(0) == pytest.approx((0.8, 0.5 ** (1 / 15)))


def test_record_learns_first_tokens_and_runs_and_censors_whole_runs():
    rec = AcceptanceRecord(ContextModel.prior(), strength=4)
    rec.update(5, accepted=0, continued=True)  # first token rejected
    assert rec.rates(5) == pytest.approx(((0.9 * 4) / 5, 0.85))
    rec.update(5, accepted=3, continued=True)  # 3 accepted, the 4th rejected: 2 continuations and 1 miss
    assert rec.rates(5) == pytest.approx(((0.9 * 4 + 1) / 6, (0.85 * 4 + 2) / 7))
    rec.update(5, accepted=4, continued=False)  # the whole chain accepted: 3 continuations, no miss
    assert rec.rates(5) == pytest.approx(((0.9 * 4 + 2) / 7, (0.85 * 4 + 5) / 10))
    assert rec.rates(4) == pytest.approx((PRIOR_FIRST[4], PRIOR_CONTINUE))  # other buckets untouched


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


def test_rejections_stop_drafting_copies_extend_it_and_fork_forgets():
    def cost(width):
        return 1.0 + 0.8 * (width - 1)

    # a fresh request drafts one token on this curve (1.9 / 1.8 > 1; two: 2.665 / 2.6 is less)
    assert CostSizedLookup(cost).propose(DraftContext(COPY, budget=4)).size == 2
    d = CostSizedLookup(cost)
    tree = d.propose(DraftContext(COPY, budget=4))
    d.observe(tree, None, Verdict([0], bonus=7))  # rejected: first-token rate 0.9 -> 3.6 / 5 = 0.72
    assert d.propose(DraftContext(COPY, budget=4)).size == 1  # 1.72 / 1.8 < 1: an AR step
    assert d.fork().record.first[5] == [0, 0]  # a new request starts from the table
    # accepted copies: the request's continuation rate rises and its drafts grow
    e = CostSizedLookup(steep)
    sizes = []
    for _ in range(6):
        tree = e.propose(DraftContext(COPY, budget=16))
        sizes.append(tree.size - 1)
        e.observe(tree, None, Verdict(list(range(tree.size)), bonus=7))  # everything accepted
    assert sizes[0] == 2 and sizes[-1] > sizes[0] and sizes == sorted(sizes), sizes
    assert e.counters["accepted"] == sum(sizes)


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


def test_bad_options_are_refused_before_the_curve_is_measured(monkeypatch):
    from types import SimpleNamespace

    from specgraft import registry

    def measure(*args, **kwargs):
        raise AssertionError("the curve was measured for a request that is refused")

    monkeypatch.setattr(registry, "backend_curve", measure)
    backend = SimpleNamespace(capabilities=None)
    for key, bad in (("chains", 0), ("max_ngram", "3"), ("chains", True)):
        with pytest.raises(SpecgraftError, match=f"integer {key} >= 1"):
            make_drafter("pld", 16, backend=backend, length="cost", **{key: bad})


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


@with_negative_control
def test_sampling_through_the_loop_matches_ar(broken, monkeypatch):
    """The first three sampled tokens through cost-sized lookup trees (a flat curve: it drafts on every match;
    the prompt repeats, so the first step verifies drafted tokens) follow AR's exact joint (chi-square,
    false-alarm rate 1e-4, 5,000 runs); a verifier that drops the residual and the sampling settings fails."""
    target = tiny_llama(vocab=6, scale=3.0, seed=3)
    exact = exact_ar_joint(target, SAMPLING_PROMPT, SAMPLING_PARAMS, 6)
    backend, drafter = TargetBackend(target), CostSizedLookup(flat)
    assert drafter.propose(DraftContext(SAMPLING_PROMPT, budget=8)).size > 1  # the rule is exercised
    check_loop(monkeypatch, broken, lambda n: sample_counts(backend, drafter, SAMPLING_PROMPT, SAMPLING_PARAMS, 8, n),
               exact, N_NEGATIVE if broken else 5000, "pld length=cost")


def test_replay_never_drafts_where_width_costs_a_full_token():
    ids = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5]
    lookup = CostSizedLookup(lambda w: float(w))  # nothing below certainty pays: every step is AR's
    r = replay(lookup, [(ids, 5)], budget=8)
    assert (r["tokens"], r["steps"], r["verify_s"]) == (10, 10, 10.0) and lookup.counters["offered"] == 0
    r = replay(CostSizedLookup(flat), [(ids, 5)], budget=8)  # free width: copies, accepted whole
    assert r["tokens"] == 10 and r["steps"] < 5 and r["verify_s"] == r["steps"]


def test_replay_of_a_greedy_decode_is_that_decode(tiny_engine):
    """The replay on (prompt, AR's output) makes the engine's own steps: same step count and accept lengths."""
    proto = tiny_engine.drafter("pld", length="cost")  # the prototype the engine's runs fork: the same curve
    checked = 0
    for prompt in ("Tell me a story.", "List the numbers."):
        out = tiny_engine.generate(prompt, "pld", max_new_tokens=60, length="cost", budget=16)
        ids = [*out.prompt_ids, *out.token_ids]
        lookup = proto.fork()
        r = replay(lookup, [(ids, len(out.prompt_ids) + 1)], budget=16)  # the prefill's token is committed first
        assert r["tokens"] == len(out.token_ids) - 1
        assert r["steps"] == out.stats.steps, prompt
        checked += lookup.counters["accepted"] > 0
    assert checked >= 1  # the replay drafted and was accepted somewhere
