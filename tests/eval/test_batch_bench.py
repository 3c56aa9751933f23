"""`specgraft batch` on the engine: continuous batching at B requests in flight, resumable records."""

import json

import pytest

from specgraft.eval.batch_bench import host_share, run_batch
from specgraft.eval.batch_bench import run_batch_bench
from specgraft.eval.harness import expand_methods

from ..test_smollm2 import PROMPTS


@pytest.mark.slow
def test_batch_bench_records_equal_outputs_and_resumes(smollm2_engine, tmp_path):
    engine = smollm2_engine
    specs = expand_methods([{"name": "ar"}, {"name": "recycle", "budget": 16}], add_ar=False)
    prompts = [engine.encode(p) for p in PROMPTS[:3]]
    out = tmp_path / "batch.jsonl"
    recs = run_batch_bench(engine, specs, prompts, [1, 2], 16, out)
    assert [(r["label"], r["batch_size"]) for r in recs] == [("ar", 1), ("recycle:budget=16", 1), ("ar", 2),
                                                              ("recycle:budget=16", 2)]
    for r in recs:
        assert r["tokens"] == sum(len(o) for o in r["outputs"]) and r["throughput"] > 0
        assert 0 <= r["host_share"] < 1 and r["steps"] > 0
        assert r["equal_to_batch1"] in (None, True)  # greedy fp32: every output equals the B = 1 output
    b1 = {r["label"]: r for r in recs if r["batch_size"] == 1}
    b2 = {r["label"]: r for r in recs if r["batch_size"] == 2}
    assert b2["ar"]["steps"] < b1["ar"]["steps"]  # two requests share each forward
    assert b1["recycle:budget=16"]["mat"] > 1.0
    lines = out.read_text().splitlines()
    again = run_batch_bench(engine, specs, prompts, [1, 2], 16, out)  # resume: nothing reruns
    assert out.read_text().splitlines() == lines and sorted(json.dumps(r) for r in again) == sorted(lines)
    assert [json.loads(x)["label"] for x in lines] == ["ar", "recycle:budget=16", "recycle:budget=16", "ar"]


@pytest.mark.slow
def test_run_batch_keeps_b_in_flight(smollm2_engine):
    engine = smollm2_engine
    prompts = [engine.encode(p) for p in PROMPTS[:5]]
    seen = []
    step = engine.step

    def spy():
        seen.append(len(engine.active))
        return step()

    engine.step = spy
    try:
        outs, stats, wall = run_batch(engine, "ar", {}, prompts, 2, 8)
    finally:
        del engine.step
    assert max(seen) == 2 and len(outs) == 5 and all(len(o) == 8 or o[-1] in engine.eos_ids for o in outs)
    assert stats.steps == len(seen) - seen.count(0) and host_share(stats) < 1
