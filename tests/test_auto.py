"""``--method auto``: the prediction picks AR or a speculative method from the latency curve, and caches."""

import json
from types import SimpleNamespace

import pytest

from specgraft import auto
from specgraft.auto import AutoChoice, below, choose_method, gate_pass_share, resolve
from specgraft.core.backend import Capabilities, torch_runtime
from specgraft.costs import WIDTHS
from specgraft.graft.calibration import Calibration


def steep(w: int) -> float:
    return 0.02 * w  # every extra slot costs a full token: width never pays


def flat(w: int) -> float:
    return 0.5  # a big target whose forward costs the same at any width (drafting is cheap beside it)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A counting fake of the latency measurement (writes its curve file as the real one does)."""
    monkeypatch.setenv("SPECGRAFT_CACHE", str(tmp_path))
    calls = []

    def measure(engine):
        calls.append(engine.model_name)
        curve = {w: measure.shape(w) for w in WIDTHS}
        path = tmp_path / "latency" / f"{auto.machine_key(engine.model_name, engine.dtype)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"seconds": curve}))
        return curve

    measure.shape = flat
    monkeypatch.setattr(auto, "latency_curve", measure)
    return SimpleNamespace(calls=calls, measure=measure, tmp=tmp_path)


def engine(name="smollm2-135m", dtype="bfloat16"):
    return SimpleNamespace(model_name=name, dtype=dtype,
                           capabilities=Capabilities("transformers", dtype, torch_runtime(), hidden_states=True))


@pytest.mark.parametrize("shape, expect", [(steep, "ar"), (flat, "graft")])
def test_choice_follows_the_latency_curve(fake, shape, expect):
    fake.measure.shape = shape
    choice = choose_method(engine())
    assert isinstance(choice, AutoChoice) and choice.method == expect
    rows = {r["method"] for r in choice.table}
    assert choice.table[0]["method"] == "ar" and {"graft", "eagle"} <= rows  # every candidate predicted
    if expect == "ar":
        assert choice.reason.startswith("AR: no speculative method is predicted to beat it on this machine")
        assert choice.budget == 0
    else:
        best = max(choice.table, key=lambda r: r["tokens_per_s"])
        assert (best["method"], best["budget"]) == (choice.method, choice.budget)
        assert best["vs_ar"] >= auto.MARGIN and choice.budget >= 1
        # same calibration and width: Graft's gated drafting makes its step no dearer than dense EAGLE's
        eagle = next(r for r in choice.table if r["method"] == "eagle")
        assert best["draft_s"] < eagle["draft_s"]


def test_choice_is_cached_and_recomputed_when_the_curve_changes(fake):
    first = choose_method(engine())
    assert choose_method(engine()) == first and len(fake.calls) == 1  # second call: no measurement
    choose_method(engine(dtype="float32"))  # another dtype is another cache entry
    assert len(fake.calls) == 2
    curve = fake.tmp / "latency" / f"{auto.machine_key('smollm2-135m', 'bfloat16')}.json"
    curve.write_text(curve.read_text() + " ")  # a re-measured curve invalidates the cached choice
    choose_method(engine())
    assert len(fake.calls) == 3


def test_a_choice_on_an_uncached_curve_is_not_cached_either(fake, monkeypatch):
    """A curve measured under contention is not cached (costs.backend_curve); the choice made on it is not
    either, so the next run measures and decides again."""
    real = fake.measure

    def uncached(engine):
        curve = real(engine)
        (fake.tmp / "latency" / f"{auto.machine_key(engine.model_name, engine.dtype)}.json").unlink()
        return curve

    monkeypatch.setattr(auto, "latency_curve", uncached)
    choose_method(engine())
    choose_method(engine())
    assert len(fake.calls) == 2 and not auto._cache_path(engine()).exists()


def test_model_without_calibration_is_ar_without_measuring(fake, tmp_path):
    choice = choose_method(engine(str(tmp_path / "my-hf-model")))
    assert choice.method == "ar" and "no calibrated speculative method" in choice.reason and not fake.calls


def test_resolve_maps_auto_and_passes_others_through(fake):
    assert resolve(engine(), "pld") == ("pld", None, {}, None)
    method, budget, options, choice = resolve(engine(), "auto")
    assert (method, budget, options) == (choice.method, choice.budget, choice.options)


def test_gate_share_from_equal_mass_bins():
    fit = {"bin_lower_edges": [i / 10 for i in range(10)]}
    assert below(fit, 0.55) == pytest.approx(0.55) and below(fit, 0.0) == 0 and below({}, 0.5) == 0
    # checkpoints 0 / 1 at depth 3 (4 passes): half stop after pass 1, none more at level 1 (nested), rest 4
    cal = Calibration(thresholds=(0.5, 0.2), checkpoints=(0, 1), meta={"fits": {"0": fit, "1": fit}})
    assert gate_pass_share(cal, 3) == pytest.approx((0.5 * 1 + 0.5 * 4) / 4)


def lookup_row(general: float, copying: float, budget: int = 16) -> dict:
    ar_tps = 1 / steep(1)
    return {"method": "pld", "options": {"length": "cost"}, "budget": budget, "mat": 1.0, "draft_s": 0.0,
            "verify_s": steep(1), "tokens_per_s": general * ar_tps, "mat_copying": 3.0, "vs_ar_copying": copying,
            "decodes": {"general": 8, "copying": 36}}


@pytest.mark.parametrize("general, copying, expect", [
    (1.01, 1.30, "pld"),  # where no tree wins: not slower on chat, faster on copying -> replaces AR
    (0.99, 1.30, "ar"),  # slower on general chat: AR stays
    (1.01, 1.02, "ar"),  # no real gain on copying either
])
def test_cost_sized_lookup_replaces_ar_only_when_not_slower_on_general_chat(general, copying, expect):
    curve = {w: steep(w) for w in WIDTHS}
    choice = auto.decide("m", curve, [], lookup_row(general, copying))
    assert choice.method == expect
    if expect == "pld":
        assert (choice.budget, choice.options) == (16, {"length": "cost"}) and "instead of AR" in choice.reason
    else:
        assert choice.reason.startswith("AR: ") and f"{general:.3f}x AR on general chat" in choice.reason
    assert auto.decide("m", curve, [], None).method == "ar"  # without the row: as before


def test_predict_lookup_replays_the_calibrations_stored_decodes():
    curve = {w: 1.0 + 0.2 * (w - 1) for w in WIDTHS}  # each extra token costs a fifth of a step
    chat = [[20, *range(100, 160)]]  # prompt length, then ids that never repeat: nothing to copy
    block = list(range(300, 340))
    copying = [[40, *block, *block, *block[:20]]]  # the output copies its prompt verbatim
    cal = Calibration(sequences=chat)
    assert auto.predict_lookup(curve, cal) is None  # no copying decodes: nothing predicted
    cal.context_sources = [{"data": "test", "sequences": copying}]
    row = auto.predict_lookup(curve, cal)
    by = row["by_budget"]
    assert set(by) == {str(b) for b in auto.LOOKUP_BUDGETS} and row["mat"] == 1.0
    assert row["vs_ar_copying"] > 2 and row["mat_copying"] > 5
    # chat never drafts, so every cap is AR plus the lookup's host time: none is safe, the cap is the best on chat
    assert all(r["general"] <= 1.0 for r in by.values()) and by[str(row["budget"])]["general"] == max(
        r["general"] for r in by.values())
    cal.sequences = [[20, *range(100, 130), *range(100, 130)]]  # chat that repeats itself: drafting pays
    row = auto.predict_lookup(curve, cal)
    by = row["by_budget"]
    assert all(r["general"] > 1.0 for r in by.values())  # every cap is safe: the best on copying is taken
    assert by[str(row["budget"])]["copying"] == max(r["copying"] for r in by.values())
