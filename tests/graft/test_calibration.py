"""Calibration (isotonic fit, thresholds, save/load, resumable run) and budget autotune (exact MAT replay)."""

import random

import pytest
import torch

from specgraft.auto import choose_budget
from specgraft.costs import interpolate
from specgraft.graft.calibration import expected_mat
from specgraft.tools.calibrate import add_context_source, refit_context, run_calibration
from specgraft.graft.calibration import Calibration, fit_threshold, isotonic
from specgraft.engine import Engine
from specgraft.registry import make_drafter
from specgraft.errors import SpecgraftError

from ..conftest import tiny_llama
from ..eagle.test_head import random_head


def test_isotonic_is_monotone_and_weighted():
    assert isotonic([0.1, 0.3, 0.2, 0.5], [1, 1, 1, 1]) == pytest.approx([0.1, 0.25, 0.25, 0.5])
    assert isotonic([0.6, 0.2], [3, 1]) == pytest.approx([0.5, 0.5])
    assert isotonic([0.1, 0.2, 0.3], [1, 1, 1]) == [0.1, 0.2, 0.3]


def test_fit_threshold_finds_the_crossing_and_falls_back():
    rng = random.Random(0)
    conf = [rng.random() for _ in range(4000)]
    outcome = [int(rng.random() < c) for c in conf]  # P(pays | c) = c: crossing at rho
    tau, info = fit_threshold(conf, outcome, rho=0.5)
    assert 0.4 < tau < 0.6 and info["n"] == 4000
    tau, _ = fit_threshold(conf, outcome, rho=0.8)
    assert 0.7 < tau < 0.9
    tau, info = fit_threshold(conf[:50], outcome[:50], rho=0.5, fallback=0.33)
    assert tau == 0.33 and "fallback" in info["rule"]
    assert fit_threshold(conf, [1] * 4000)[0] == 0.02  # always pays: clamped low
    assert fit_threshold(conf, [0] * 4000)[0] == 0.9  # never pays: clamped high


def test_expected_mat_replays_smaller_budgets():
    ranks = [[0, 2, 5], [], [1], [0, 1, 3, 9]]
    assert expected_mat(ranks, 100) == pytest.approx((4 + 1 + 2 + 5) / 4)
    assert expected_mat(ranks, 1) == pytest.approx((2 + 1 + 1 + 2) / 4)
    assert expected_mat(ranks, 3) == pytest.approx((3 + 1 + 2 + 3) / 4)
    curve = {1: 0.1, 16: 0.1, 64: 0.4}
    assert interpolate(curve, 40) == pytest.approx(0.25) and interpolate(curve, 80) == pytest.approx(0.5)
    best, table = choose_budget(curve, ranks, 0.0, 30)
    assert best == 10 and len(table) == 30  # slots up to 16 are free; rank 9 is the deepest accepted: 10 suffices
    with pytest.raises(SpecgraftError, match="calibrate"):
        choose_budget(curve, [], 0.0, 30)


def test_calibration_run_saves_loads_and_resumes(tmp_path):
    from transformers import AutoTokenizer

    from specgraft import models

    tok = AutoTokenizer.from_pretrained(models.resolve("smollm2-135m"))
    target = tiny_llama(vocab=len(tok), layers=4, scale=8.0)
    engine = Engine.from_model(target, tok, "tiny")
    ids = list(range(len(tok)))[:64]
    inner = make_drafter(
        "eagle", len(tok), target=target, head=random_head(target, ids), top_k=3, depth=5)
    convs = [(str(i), [{"role": "user", "content": f"Count to {i} please."},
                       {"role": "assistant", "content": " ".join(map(str, range(i)))}]) for i in range(3, 9)]
    state = tmp_path / "state.pt"
    cal = run_calibration(engine, inner, convs, rounds=2, max_new_tokens=24, budget=12, extra=1, state_path=state)
    assert cal.meta["round"] == 2 and cal.meta["extra"] == 1 and cal.meta["rows_filled"] > 0
    assert len(cal.accepted_ranks) == cal.meta["steps"] and all(r == sorted(r) for r in cal.accepted_ranks)
    assert cal.thresholds == (0.35, 0.25, 0.15)  # < 200 observations: the fallback, said so in the fits
    assert all("fallback" in f["rule"] for f in cal.meta["fits"].values())
    cal.save(tmp_path / "cal")
    back = Calibration.load(tmp_path / "cal")
    assert back.thresholds == cal.thresholds and back.accepted_ranks == cal.accepted_ranks
    assert torch.equal(back.snapshot["succ"], cal.snapshot["succ"])
    # resume: the state file says both rounds are done, so nothing is decoded again
    again = run_calibration(engine, inner, convs, rounds=2, max_new_tokens=24, budget=12, extra=1, state_path=state)
    assert again.meta["steps"] == cal.meta["steps"] and again.meta["seconds"] == pytest.approx(cal.meta["seconds"])
    with pytest.raises(SpecgraftError, match="no calibration"):
        Calibration.load(tmp_path / "nothing")
    # the context table is fitted on the rounds' decodes, which the calibration keeps
    assert len(cal.sequences) == 2 and cal.context["sequences"] == 2
    assert cal.context["positions"] == sum(len(s) - 1 - s[0] - 1 for s in cal.sequences)
    assert back.context == cal.context and back.sequences == cal.sequences
    prov = back.provenance()["context"]
    assert prov["positions"] == cal.context["positions"] and len(prov["first_token_by_bucket"]) == 6
    head = cal.head_expected(16)
    assert len(head) == 17 and head[0] == 0 and head[16] == pytest.approx(expected_mat(cal.accepted_ranks, 16) - 1)
    # --context-only re-decodes the same prompts with prompt lookup: lossless, so the same sequences and table
    bare = Calibration(meta={"rounds": 2, "max_new_tokens": 24})
    refit_context(engine, bare, convs)
    assert bare.sequences == cal.sequences and bare.context == cal.context
    with pytest.raises(SpecgraftError, match="does not record its warm-up rounds"):
        refit_context(engine, Calibration(meta={}), convs)


def test_added_context_data_is_decoded_once_fitted_beside_the_warmup_and_replaced_not_doubled(tmp_path):
    """``calibrate --context-only --data``: the added decodes are AR's text, the table is fitted on warm-up plus
    added decodes, the same source added again replaces itself, and a sibling reuses the decodes as they are."""
    from transformers import AutoTokenizer

    from specgraft import models
    from specgraft.graft.context import fit_context

    tok = AutoTokenizer.from_pretrained(models.resolve("smollm2-135m"))
    engine = Engine.from_model(tiny_llama(vocab=len(tok), layers=2, scale=8.0), tok, "tiny")
    warm = [[3, 10, 11, 12, 10, 11, 12, 13]]
    cal = Calibration(meta={"rounds": 1, "max_new_tokens": 8}, sequences=[list(warm[0])])
    text = "alpha beta gamma delta epsilon zeta eta theta " * 6  # a prompt the decode can copy from
    convs = [(str(i), [{"role": "user", "content": f"Repeat: {text} {i}"}]) for i in range(3)]
    source = {"data": "test", "skip": 0, "rounds": 2, "max_new_tokens": 12, "backend": "transformers",
              "weights": "float32"}
    with pytest.raises(SpecgraftError, match="no warm-up decodes"):
        add_context_source(engine, Calibration(), source, convs)
    with pytest.raises(SpecgraftError, match="fewer than --rounds 2"):
        add_context_source(engine, cal, source, convs[:1])
    add_context_source(engine, cal, source, convs)
    added = cal.context_sources[0]["sequences"]
    assert len(cal.context_sources) == 1 and len(added) == 2
    for seq, (_, msgs) in zip(added, convs):  # each decode is the prompt then AR's greedy continuation
        prompt = seq[1:1 + seq[0]]
        assert seq[1 + seq[0]:] == engine.generate(prompt, "ar", max_new_tokens=12).token_ids
    assert cal.context == fit_context([(s[1:], s[0]) for s in [*warm, *added]])
    assert cal.context["sequences"] == 3
    add_context_source(engine, cal, source, convs)  # the same settings again: replaced, not doubled
    assert len(cal.context_sources) == 1 and cal.context["sequences"] == 3
    add_context_source(engine, cal, {**source, "skip": 1}, convs[1:])  # another source: added beside it
    assert len(cal.context_sources) == 2 and cal.context["sequences"] == 5
    cal.save(tmp_path / "cal")
    back = Calibration.load(tmp_path / "cal")
    assert back.context_sources == cal.context_sources and back.context == cal.context
    assert back.provenance()["context"]["added_sources"][0]["data"] == "test"
    sibling = Calibration(meta={}, sequences=[list(warm[0])])
    calls = []
    engine.generate = lambda *a, **k: calls.append(a)  # a reused source decodes nothing
    add_context_source(engine, sibling, cal.context_sources[0], convs)
    assert not calls and sibling.context == fit_context([(s[1:], s[0]) for s in [*warm, *added]])


def test_provenance_states_data_size_and_fallbacks():
    tree = Calibration(meta={"data": "sharegpt (default)", "skip": 1000, "rounds": 8, "rho": 0.5, "drafter": "eagle",
                             "fits": {"0": {"n": 164, "rule": "fallback (< 200 observations)"},
                                      "1": {"n": 250, "rule": "first bin with monotone rate >= 0.5",
                                            "rate": [0.1, 0.3, 0.6]},
                                      "5": {"n": 250, "rule": "first bin with monotone rate >= 0.5",
                                            "rate": [0.0, 0.2, 0.4]}},
                             "tail_fit": {"n": 0, "rule": "fallback (< 200 observations)"}})
    p = tree.provenance()
    assert p["data"] == "sharegpt (default)" and p["skip"] == 1000
    assert p["observations"] == {"0": 164, "1": 250, "5": 250}  # a tree reports its checkpoints, not the tail
    assert p["fallback"] == ["0"] and p["no_bin_reached_rho"] == ["5"]
    chain = Calibration(meta={"drafter": "draft-chain", "rho": 0.5, "fits": {"0": {"n": 0, "rule": "fallback"}},
                              "tail_fit": {"n": 2100, "rule": "first bin", "rate": [0.2, 0.7]}})
    assert chain.provenance()["observations"] == {"tail": 2100} and chain.provenance()["fallback"] == []
    assert Calibration().provenance()["data"] == "unrecorded"
    assert Calibration().provenance()["context"].startswith("prior")
