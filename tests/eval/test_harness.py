import json

import pytest

from specgraft.env import amx_state, cpu_id
from specgraft.errors import SpecgraftError
from specgraft.eval.harness import BenchConfig, MethodSpec, expand_methods, parse_method, read_records, run_harness
from specgraft.eval.report import load, markdown, plots

RECORD_FIELDS = {"schema", "dataset", "prompt_id", "category", "turn", "n_turns", "seed", "label", "method",
                 "method_config", "model", "dtype", "max_new_tokens", "sampling", "greedy", "lossy", "machine",
                 "versions", "commit", "prompt_tokens", "output_ids", "text", "new_tokens", "steps",
                 "accept_lengths", "mat", "depth_trials", "depth_accepts", "tree_nodes", "wall_s", "prefill_s",
                 "draft_s", "verify_s", "other_s", "retrieval_state"}


def test_expand_methods_sweeps_and_adds_ar():
    specs = expand_methods([{"name": "recycle", "budget": [16, 80], "scope": "hot"}, {"name": "pld"}])
    assert [s.label for s in specs] == ["ar", "recycle:budget=16,scope=hot", "recycle:budget=80,scope=hot", "pld"]
    assert parse_method("recycle:budget=16,scope=hot") == {"name": "recycle", "budget": 16, "scope": "hot"}
    with pytest.raises(SpecgraftError, match="unknown method"):
        expand_methods([{"name": "medusa"}])
    with pytest.raises(SpecgraftError, match="no option"):
        expand_methods([{"name": "pld", "k": 3}])


def test_config_file_errors(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text("modle = 'x'\n")
    with pytest.raises(SpecgraftError, match="unknown key"):
        BenchConfig.from_toml(str(bad))
    bad.write_text("model = \n")
    with pytest.raises(SpecgraftError, match="invalid TOML"):
        BenchConfig.from_toml(str(bad))


def make_cfg(tmp_path) -> BenchConfig:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(o) for o in [
        {"id": "one", "turns": ["Count to five.", "Now backwards."], "category": "chat"},
        {"id": "two", "prompt": "Say the alphabet.", "category": "list"},
        {"id": "three", "prompt": "Repeat: a b c a b c a b c", "category": "list"}]) + "\n")
    return BenchConfig(model="tiny", dtype="float32", max_new_tokens=24, warmup=1, seeds=[0],
                       datasets=[{"name": str(prompts)}],
                       methods=[{"name": "pld"}, {"name": "recycle", "budget": [8, 80]}])


def test_records_resume_and_report(tmp_path, tiny_engine):
    cfg = make_cfg(tmp_path)
    out = tmp_path / "runs" / "rec.jsonl"
    res = run_harness(cfg, str(out), engine=tiny_engine, log=lambda m: None)
    assert res == {"ran": 12, "skipped": 0, "total": 12}
    recs, problems = read_records(out)
    assert not problems and len(recs) == 16  # 4 methods x (2 + 1 + 1 turns)
    assert RECORD_FIELDS <= set(recs[0])
    assert recs[0]["machine"]["amx"] == amx_state() and recs[0]["machine"]["isa"]  # which matrix engine ran
    assert recs[0]["machine"]["cpu_id"] == cpu_id()  # which CPU of that name (family-model)
    assert {r["turn"] for r in recs if r["prompt_id"] == "one"} == {0, 1}
    assert all(r["lossy"] is False and r["commit"] for r in recs)
    assert {r["retrieval_state"] for r in recs if r["method"] == "recycle"} == {"cold"}
    assert any(r["mat"] > 1 for r in recs if r["method"] == "recycle")  # real trees were verified

    # Resume: nothing new runs; then cut the file mid-conversation and only that conversation reruns.
    assert run_harness(cfg, str(out), engine=tiny_engine, log=lambda m: None)["ran"] == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    rep = load([str(out)])
    assert not rep.ok and any("truncated" in p for p in rep.problems)
    assert run_harness(cfg, str(out), engine=tiny_engine, log=lambda m: None)["ran"] == 1
    rep = load([str(out)])
    assert rep.ok and len(rep.records) == 16

    # fp32 greedy: every lossless method equals AR by token ids.
    assert not any(rep.mismatches.values())
    md = markdown(rep, "specgraft bench --config x")
    assert "| all | ar |" in md and "identical" in md and "Reproduce: `specgraft bench --config x`" in md
    paths = plots(rep, tmp_path / "plots")
    assert all(p.exists() and p.stat().st_size > 1000 for p in paths)


def test_exactness_check_fails_on_mismatch_and_missing(tmp_path, tiny_engine):
    cfg = make_cfg(tmp_path)
    cfg.methods = [{"name": "pld"}]
    out = tmp_path / "r.jsonl"
    run_harness(cfg, str(out), engine=tiny_engine, log=lambda m: None)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    victim = next(r for r in recs if r["label"] == "pld")
    victim["output_ids"] = victim["output_ids"][:3] + [victim["output_ids"][3] + 1] + victim["output_ids"][4:]
    recs = [r for r in recs if not (r["label"] == "pld" and r["prompt_id"] == "two")]
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rep = load([str(out)])
    assert rep.mismatches["pld"] == [((victim["dataset"], victim["prompt_id"], victim["turn"], 0), 3)]
    assert any("pld has no record" in m for m in rep.missing) and not rep.ok


def test_warmup_is_outside_the_data_and_order_rotates_over_the_run(tmp_path, tiny_engine):
    """Warm-up never runs an evaluation prompt; the method order rotates over the whole run (across
    datasets), so with one prompt per dataset every method still leads once."""
    from specgraft.eval.harness import WARMUP_PROMPT

    datasets = []
    for name in ("a", "b", "c"):
        f = tmp_path / f"{name}.jsonl"
        f.write_text(json.dumps({"id": name, "prompt": f"Say {name} three times."}) + "\n")
        datasets.append({"name": str(f)})
    cfg = BenchConfig(model="tiny", dtype="float32", max_new_tokens=4, warmup=1, seeds=[0], datasets=datasets,
                      methods=[{"name": "pld"}, {"name": "recycle"}], score=False)
    calls = []
    real = tiny_engine.generate

    def spy(prompt, method, **kw):
        calls.append((prompt if isinstance(prompt, str) else prompt[-1]["content"], method))
        return real(prompt, method, **kw)

    tiny_engine.generate = spy
    try:
        run_harness(cfg, str(tmp_path / "r.jsonl"), engine=tiny_engine, log=lambda m: None)
    finally:
        del tiny_engine.generate
    warm, timed = calls[:3], calls[3:]
    assert all(p == WARMUP_PROMPT for p, _ in warm) and {m for _, m in warm} == {"ar", "pld", "recycle"}
    assert all(p != WARMUP_PROMPT for p, _ in timed)
    leads = [timed[i][1] for i in range(0, 9, 3)]  # the first method of each prompt
    assert leads == ["ar", "pld", "recycle"]


def test_noise_pairs_and_spec_in_records(tmp_path, tiny_engine):
    """A ``label`` key runs one configuration twice; records carry the label-free configuration, and the
    model field is the target's (a drafter's own model option is ``draft_model``)."""
    specs = expand_methods([{"name": "pld"}, {"name": "pld", "label": "pld#2"}])
    assert [s.label for s in specs] == ["ar", "pld", "pld#2"] and specs[1].describe() == specs[2].describe()
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "x", "prompt": "Say hi."}) + "\n")
    cfg = BenchConfig(model="tiny", dtype="float32", max_new_tokens=4, datasets=[{"name": str(f)}],
                      methods=[{"name": "pld"}, {"name": "pld", "label": "pld#2"}], score=False)
    run_harness(cfg, str(tmp_path / "r.jsonl"), engine=tiny_engine, log=lambda m: None)
    recs, _ = read_records(tmp_path / "r.jsonl")
    by = {r["label"]: r for r in recs}
    assert by["pld"]["spec"] == by["pld#2"]["spec"] != by["ar"]["spec"]
    assert "dirty" in by["pld"]


@pytest.mark.slow
def test_methods_on_other_weights_run_in_the_same_interleaved_run(tmp_path):
    """A method entry's ``dtype`` (or ``backend``) runs it on its own engine in the same run: records carry the
    weights each ran on, and the spec names them only where they differ from the config's."""
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "x", "prompt": "Say hi."}) + "\n")
    cfg = BenchConfig(model="smollm2-135m", dtype="float32", max_new_tokens=4, warmup=0, datasets=[{"name": str(f)}],
                      methods=[{"name": "ar"}, {"name": "ar", "label": "ar-bf16", "dtype": "bfloat16"}], score=False)
    run_harness(cfg, str(tmp_path / "r.jsonl"), log=lambda m: None)
    by = {r["label"]: r for r in read_records(tmp_path / "r.jsonl")[0]}
    assert by["ar"]["dtype"] == "float32" and by["ar-bf16"]["dtype"] == "bfloat16"
    assert "dtype" not in by["ar"]["spec"] and by["ar-bf16"]["spec"]["dtype"] == "bfloat16"
    with pytest.raises(SpecgraftError, match="no option"):
        expand_methods([{"name": "ar", "weights": "int4"}])


def test_batched_groups_equal_the_sequential_run_and_resume(tmp_path, tiny_engine):
    """``batch = 2``: each method runs two conversations in flight (a two-turn one's second turn joins when its
    first ends); fp32 greedy gives the sequential run's tokens; records carry their group; an interrupted group
    resumes by its missing conversations only; a bad ``batch`` is refused."""
    seq, bat = make_cfg(tmp_path), make_cfg(tmp_path)
    bat.batch = 2
    run_harness(seq, str(tmp_path / "seq.jsonl"), engine=tiny_engine, log=lambda m: None)
    out = tmp_path / "bat.jsonl"
    assert run_harness(bat, str(out), engine=tiny_engine, log=lambda m: None) == {"ran": 12, "skipped": 0,
                                                                                 "total": 12}
    key = lambda r: (r["prompt_id"], r["label"], r["turn"])  # noqa: E731
    want = {key(r): r["output_ids"] for r in read_records(tmp_path / "seq.jsonl")[0]}
    recs = read_records(out)[0]
    assert {key(r): r["output_ids"] for r in recs} == want
    assert {(r["prompt_id"], r["batch"]["group"], r["batch"]["in_flight"]) for r in recs} == {
        ("one", 0, 2), ("two", 0, 2), ("three", 1, 1)}
    for r in recs:
        same = [x for x in recs if x["label"] == r["label"] and x["batch"]["group"] == r["batch"]["group"]]
        assert r["batch"]["new_tokens"] == sum(x["new_tokens"] for x in same) and r["batch"]["wall_s"] > 0
    assert {r["label"] for r in recs if r["batch"]["group"] == 0} == {"ar", "pld", "recycle:budget=8",
                                                                       "recycle:budget=80"}
    # drop one conversation of a group: only it reruns, alone
    kept = [r for r in recs if not (r["prompt_id"] == "two" and r["label"] == "pld")]
    out.write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert run_harness(bat, str(out), engine=tiny_engine, log=lambda m: None)["ran"] == 1
    again = [r for r in read_records(out)[0] if r["prompt_id"] == "two" and r["label"] == "pld"]
    assert [r["output_ids"] for r in again] == [want[("two", "pld", 0)]] and again[0]["batch"]["in_flight"] == 1
    bad = tmp_path / "b.toml"
    bad.write_text("batch = 0\n")
    with pytest.raises(SpecgraftError, match="batch must be"):
        BenchConfig.from_toml(str(bad))


def test_auto_dtype_and_its_resolved_name_share_one_engine(monkeypatch):
    from specgraft import env

    monkeypatch.setattr(env, "bf16_path", lambda: False)  # a CPU without packed bf16: auto is float32
    cfg = BenchConfig(dtype="auto")
    keys = {MethodSpec("a", "ar").engine_key(cfg), MethodSpec("b", "ar", dtype="float32").engine_key(cfg)}
    assert keys == {("transformers", "float32")}
    assert MethodSpec("c", "ar", dtype="bfloat16").engine_key(cfg) == ("transformers", "bfloat16")
