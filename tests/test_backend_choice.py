"""``--backend auto``: the candidates that can run a model, the pick follows the measured curves, the decision
is cached and recomputed when a curve changes, and the chosen engine runs (SmolLM2)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specgraft import backend_choice, costs
from specgraft.backend_choice import BackendChoice, Option, choose_backend, options, pick
from specgraft.errors import SpecgraftError


def row(label, weights, tps, method="ar", budget=0, options=None):
    return {"backend": label, "label": label, "weights": weights, "method": method, "options": options or {},
            "budget": budget, "tokens_per_s": tps, "ar_tokens_per_s": tps}


def test_pick_takes_the_fastest_and_names_the_others_in_order():
    rows = [row("transformers", "bfloat16", 8.0, "graft", 12), row("llama.cpp", "gguf", 35.5),
            row("transformers", "int4", 17.2, "graft", 3, {"drafter": "draft-tree"})]
    best, reason = pick(rows)
    assert (best["label"], best["weights"]) == ("llama.cpp", "gguf")
    assert reason.startswith("predicted llama.cpp gguf: 35.5 tok/s (AR); transformers int4: 17.2 tok/s (graft "
                             "drafter=draft-tree budget 3); transformers bfloat16: 8.0 tok/s (graft budget 12).")
    best, reason = pick([row("transformers", "bfloat16", 8.0)])
    assert "no other backend can run this model here" in reason


@pytest.mark.parametrize("model, dtype, device, llama, expect", [
    ("smollm2-135m", "bfloat16", "cpu", True,
     [("llamacpp", "bfloat16"), ("transformers", "int4"), ("transformers", "bfloat16")]),
    ("smollm2-135m", "int4", "cpu", True, [("llamacpp", "int4"), ("transformers", "int4")]),  # int4 once
    ("smollm2-135m", "float32", "cpu", False, [("transformers", "int4"), ("transformers", "float32")]),
    ("smollm2-135m", "bfloat16", "cuda", True, [("transformers", "bfloat16")]),  # int4 and llama.cpp: CPU only
    ("/some/model.gguf", "bfloat16", "cpu", True, [("llamacpp", "bfloat16")]),
    ("/some/hf-dir", "float32", "cpu", True, [("transformers", "float32")]),  # no GGUF: no codes, no llama.cpp
])
def test_candidates_are_the_backends_that_can_run_the_model(model, dtype, device, llama, expect):
    assert options(model, dtype, device, llama) == [Option(b, d) for b, d in expect]


@pytest.mark.parametrize("has_bf16_path, dense", [(False, ["float32", "bfloat16"]), (True, ["bfloat16"])])
def test_dtype_auto_scores_both_dense_dtypes_where_bf16_is_emulated(monkeypatch, has_bf16_path, dense):
    """Without a packed bf16 path, fp32 is cheaper from 3-4 tokens a forward and bf16 at 1-2: both are scored."""
    from specgraft import env

    monkeypatch.setattr(env, "bf16_path", lambda: has_bf16_path)
    got = options("smollm2-135m", "auto", "cpu", False)
    assert got == [Option("transformers", "int4")] + [Option("transformers", d) for d in dense]
    assert options("/some/hf-dir", "auto", "cpu", True) == [Option("transformers", d) for d in dense]


def test_no_candidate_is_one_clear_error():
    with pytest.raises(SpecgraftError, match="no backend can run '/x.gguf' with --dtype bfloat16 on cuda"):
        options("/x.gguf", "bfloat16", "cuda", True)


@pytest.fixture
def own_cache(tmp_path, monkeypatch, smollm2_engine):
    """A fresh latency cache; the converted model and assembled GGUF are shared."""
    from specgraft.backends.llamacpp import import_llama_cpp
    from specgraft.models import cache_root, gguf_file

    import_llama_cpp()  # these tests need every candidate (CI installs the llamacpp extra)
    gguf_file("smollm2-135m")
    for sub in ("models", "gguf"):
        (tmp_path / sub).symlink_to(cache_root() / sub)
    monkeypatch.setenv("SPECGRAFT_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def fake_curves(monkeypatch):
    """Curves by weights format, written to the real cache files as a measurement would; counts measurements."""
    speeds = {"gguf": 0.002, "int4": 0.020, "bfloat16": 0.040, "float32": 0.001}  # far apart: no method closes them
    measured = []

    def measure(backend, vocab_size, widths=costs.WIDTHS, prefix=256, reps=3):
        measured.append(backend.capabilities.weights)
        return {w: speeds[backend.capabilities.weights] * (1 + w / 100) for w in widths}

    monkeypatch.setattr(costs, "measure_curve", measure)
    return speeds, measured


@pytest.mark.slow
def test_choice_follows_the_curves_is_cached_and_recomputed_when_one_changes(own_cache, fake_curves):
    speeds, measured = fake_curves
    choice, (backend, _) = choose_backend("smollm2-135m", "bfloat16")
    assert (choice.backend, choice.weights) == ("llamacpp", "gguf")  # the cheapest forward wins
    assert backend.capabilities.weights == "gguf" and backend.capabilities.name == "llamacpp"
    assert sorted(measured) == ["bfloat16", "gguf", "int4"]  # each candidate measured once
    assert [r["weights"] for r in choice.table] == ["gguf", "int4", "bfloat16"]
    assert choice.table[0]["tokens_per_s"] > choice.table[1]["tokens_per_s"] > choice.table[2]["tokens_per_s"]

    again, (backend, _) = choose_backend("smollm2-135m", "bfloat16")  # cached: nothing measured again
    assert again == choice and len(measured) == 3 and backend.capabilities.weights == "gguf"

    # a re-measured curve (here: llama.cpp's made 100x slower) invalidates the decision
    path = Path(next(r["curve"] for r in choice.table if r["weights"] == "gguf"))
    body = json.loads(path.read_text())
    body["seconds"] = {w: 100 * s for w, s in body["seconds"].items()}
    path.write_text(json.dumps(body))
    flipped, (backend, _) = choose_backend("smollm2-135m", "bfloat16")
    assert (flipped.backend, flipped.dtype, flipped.weights) == ("transformers", "int4", "int4")
    assert backend.capabilities.weights == "int4" and len(measured) == 3  # the curves themselves were cached


@pytest.mark.slow
def test_engine_with_dtype_auto_scores_fp32_and_bf16_where_bf16_is_emulated(own_cache, fake_curves, monkeypatch):
    from specgraft import Engine
    from specgraft import env

    monkeypatch.setattr(env, "bf16_path", lambda: False)
    speeds, measured = fake_curves
    engine = Engine("smollm2-135m", "auto", backend="auto")
    assert sorted(measured) == ["bfloat16", "float32", "gguf", "int4"]
    assert (engine.backend_choice.backend, engine.dtype) == ("transformers", "float32")  # its curve is cheapest
    speeds["float32"] = 0.080  # now the dearest: bf16 is the cheaper dense dtype, llama.cpp the fastest overall
    for curve in (own_cache / "latency").glob("*float32*"):
        curve.unlink()
    engine = Engine("smollm2-135m", "auto", backend="auto")
    assert [r["weights"] for r in engine.backend_choice.table] == ["gguf", "int4", "bfloat16", "float32"]


@pytest.mark.slow
def test_a_candidate_that_cannot_open_is_left_out_and_said(own_cache, fake_curves, monkeypatch):
    real = backend_choice.open_backend

    def no_int4(kind, model, dtype, *args):
        if dtype == "int4":
            raise SpecgraftError("int4 broken here")
        return real(kind, model, dtype, *args)

    monkeypatch.setattr(backend_choice, "open_backend", no_int4)
    choice, _ = choose_backend("smollm2-135m", "bfloat16")
    assert [r["weights"] for r in choice.table] == ["gguf", "bfloat16"]
    assert choice.reason.endswith("transformers (int4) left out: int4 broken here")


@pytest.mark.slow
def test_generate_backend_auto_measures_says_and_records_its_choice(own_cache):
    """The real thing on SmolLM2: every candidate's curve measured here, the fastest predicted one runs."""
    env = {**os.environ, "SPECGRAFT_CACHE": str(own_cache)}
    r = subprocess.run([sys.executable, "-m", "specgraft", "generate", "Say hello.", "--backend", "auto", "--method",
                        "ar", "--max-new-tokens", "8", "--json"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    choice = BackendChoice(**record["config"]["backend_auto"])
    fastest = max(choice.table, key=lambda x: x["tokens_per_s"])
    assert (choice.backend, choice.weights) == (fastest["backend"], fastest["weights"])
    assert record["config"]["backend"] == choice.backend and record["config"]["dtype"] == choice.weights
    assert {x["weights"] for x in choice.table} == {"gguf", "int4", "bfloat16"}
    assert all(Path(x["curve"]).exists() for x in choice.table)  # measured and cached per machine
    assert f"backend auto: {choice.describe()} — predicted" in r.stderr
    assert len(record["token_ids"]) >= 1
