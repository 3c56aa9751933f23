"""Bad input gets one line on stderr and a non-zero exit, never a traceback."""

import json
import os
import subprocess
import sys

import pytest


def cli(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "specgraft", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture
def own_cache(tmp_path, smollm2_engine):
    """An environment whose latency / auto caches are fresh (the converted models are shared, not copied)."""
    from specgraft.models import cache_root

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "models").symlink_to(cache_root() / "models")
    return {**os.environ, "SPECGRAFT_CACHE": str(tmp_path / "cache")}


@pytest.mark.parametrize("args, message", [
    (["generate", ""], "empty prompt"),
    (["generate", "hi", "--method", "foo"], "unknown method 'foo'"),
    (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "hi", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--top-k", "-2"], "top_k must be an integer"),
    (["generate", "hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["generate", "hi", "--dtype", "int3"], "unknown dtype"),
    (["bench", "--prompts", "x.jsonl"], "prompt file not found"),
    (["bench", "--methods", "ar;nope"], "unknown method 'nope'"),
    (["bench", "--seeds", "a,b"], "--seeds must be comma-separated integers"),
    (["report", "no-such-file.jsonl"], "records file not found"),
    (["generate", "hi", "--method", "eagle", "--head", "/no/such/head"], "head '/no/such/head' not found"),
    (["generate", "hi", "--method", "eagle", "--eagle-top-k", "0"], "eagle needs integer 1 <= top_k"),
    (["train-head", "--out", "/tmp/x", "--ttt-steps", "0"], "--ttt-steps must be >= 1"),
    (["generate", "hi", "--method", "graft", "--opt", "variant=nope"], "variant 'nope' is not available"),
    (["generate", "hi", "--method", "graft", "--opt", "drafter=x"], "unknown drafter 'x'"),
    (["generate", "hi", "--method", "graft", "--opt", "nokey"], "bad method option 'nokey'"),
    (["generate", "hi", "--method", "prune", "--opt", "policy=foo"], "unknown pruning policy 'foo'"),
    (["generate", "hi", "--method", "graft", "--opt", "calibration=/no/cal"], "no calibration in /no/cal"),
    (["generate", "hi", "--budget", "many"], "--budget must be an integer or 'auto'"),
    (["generate", "hi", "--method", "ar", "--budget", "auto"], "--budget auto needs a tree method"),
    (["generate", "hi", "--budget", "5"], "--budget needs an explicit --method (auto chooses its own)"),
    (["generate", "hi", "--opt", "k=4", "--head", "h"], "--head / --opt need an explicit --method"),
    (["generate", "hi", "--verify", "lossy:lenience:0.5", "--temperature", "0.7"],
     "--method auto chooses among lossless methods only"),
    (["generate", "hi", "--method", "ar", "--compare"], "--compare compares a speculative method with AR"),
    (["calibrate", "--drafter", "nope"], "unknown drafter 'nope'"),
    (["calibrate", "--rho", "1.5"], "--rho must be in (0, 1)"),
    (["calibrate", "--rounds", "0"], "--rounds + --extra must be at least 1"),
    (["calibrate", "--backend", "llamacpp"], "--backend applies to --context-only --data decodes"),
    (["calibrate", "--context-only", "--data", "copyheavy", "--out", "/no/cal"], "no calibration in /no/cal"),
    (["calibrate", "--context-only", "--data", "copyheavy", "--rounds", "0", "--extra", "1"], "--rounds must be >= 1"),
    (["calibrate", "--context-only", "--data", "humaneval"], "fewer than --rounds 5"),  # past --skip 1000: none
    (["train-head", "--out", "/tmp/x", "--data", "/no/such.jsonl"], "dataset file not found"),
    (["generate", "hi", "--verify", "lossy:nope:0.5"], "unknown lossy rule 'nope'"),
    (["generate", "hi", "--verify", "lossy:lenience:0.5", "--method", "draft"], "needs sampling (temperature > 0)"),
    (["generate", "hi", "--verify", "lossy:cos:0.5", "--method", "eagle", "--temperature", "0.7"],
     "needs draft probabilities"),
    (["generate", "hi", "--verify", "lossy:lenience:1.5", "--temperature", "0.7"], "l must be in (0, 1]"),
    (["generate", "hi", "--verify", "lossy:lenience:0.5", "--temperature", "0.7", "--method", "ar"],
     "needs a speculative method"),
    (["generate", "hi", "--min-p", "1.2", "--temperature", "0.7"], "min_p must be in [0, 1]"),
    (["bench", "--methods", "draft:verify=lossy:cap:0.2", "--prompts", "humaneval"], "needs sampling"),
    (["bench", "--methods", "eagle:verify=lossy:interp:0.2", "--temperature", "0.7"], "needs draft probabilities"),
    (["distortion", "--modes", "sideways"], "--modes must be chain, tree"),
    (["distortion", "--rules", "lossless"], "lossy:RULE:PARAM specs only"),
    (["distortion", "--temperature", "0"], "--temperature must be > 0"),
    (["distortion", "--tree-method", "draft:width=3"], "--tree-method must be eagle, graft or draft"),
    (["distortion", "--backend", "gpu"], "--backend must be one of"),
    (["train-head", "--out", "/tmp/x", "--device", "tpu"], "--device tpu is not available"),
    (["generate", "hi", "--backend", "onnx"], "unknown backend 'onnx'"),
    (["generate", "hi", "--device", "tpu"], "unknown device 'tpu'"),
    (["generate", "hi", "--method", "llama_pld"], "runs on --backend llamacpp only"),
])
def test_bad_input_one_line_error(args, message):
    r = cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_bench_bad_prompt_file_writes_nothing(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"nothing": 1}\n')
    out = tmp_path / "out.jsonl"
    r = cli("bench", "--prompts", str(bad), "--out", str(out))
    assert r.returncode == 2 and "no prompt field" in r.stderr and not out.exists()


@pytest.mark.slow
def test_generate_json_and_over_long_prompt(smollm2_engine):
    r = cli("generate", "Say hello.", "--method", "pld", "--dtype", "float32", "--max-new-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["config"]["method"] == "pld" and rec["stats"]["new_tokens"] <= 8 and rec["token_ids"]
    r = cli("generate", "word " * 9000)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: prompt too long") and "Traceback" not in r.stderr


@pytest.mark.slow
def test_generate_streams_then_stats_line(smollm2_engine):
    r = cli("generate", "Name three colours.", "--method", "recycle", "--max-new-tokens", "16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "[recycle]" in r.stderr and "MAT" in r.stderr


@pytest.mark.slow
def test_generate_auto_prints_its_choice_and_records_it(own_cache):
    r = cli("generate", "Say hello.", "--max-new-tokens", "8", "--json", env=own_cache)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("method auto: "))
    rec = json.loads(r.stdout)
    choice = rec["config"]["auto"]
    assert choice["method"] == rec["config"]["method"] and f"(budget {choice['budget']}) — " in line
    assert choice["table"][0]["method"] == "ar" and len(choice["table"]) >= 3  # AR, graft, eagle


@pytest.mark.slow
def test_compare_prints_both_speeds_ratio_and_equal_greedy_texts(own_cache):
    r = cli("generate", "Name three colours.", "--method", "graft", "--budget", "7", "--compare", "--dtype",
            "float32", "--max-new-tokens", "16", env=own_cache)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "legend:" in out and "ar: " in out and "graft (budget 7): " in out and out.count(" tok/s, MAT ") == 2
    assert "speed ratio graft / ar: " in out and "texts identical" in out
    r = cli("generate", "Name three colours.", "--compare", "--json", "--dtype", "float32", "--max-new-tokens",
            "16", env=own_cache)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    ar, sd = got["ar"], got["method"]
    assert ar["config"]["method"] == "ar" and sd["config"]["method"] != "ar" and got["auto"]["table"]
    assert got["identical"] and ar["token_ids"] == sd["token_ids"] and ar["text"] == sd["text"]
    ratio = sd["stats"]["tokens_per_s"] / ar["stats"]["tokens_per_s"]
    assert got["speed_ratio"] == pytest.approx(ratio, rel=1e-2)


@pytest.mark.slow
def test_bench_and_report_commands(tmp_path, smollm2_engine):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Count from one to ten in words.\nName the days of the week.\n")
    out = tmp_path / "rec.jsonl"
    r = cli("bench", "--prompts", str(prompts), "--methods", "pld;recycle:budget=16", "--dtype", "float32",
            "--max-new-tokens", "24", "--out", str(out), "--warmup", "0")
    assert r.returncode == 0, r.stderr
    assert "| all | ar |" in r.stdout and "| all | recycle:budget=16 |" in r.stdout and "identical" in r.stdout
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 6 and {r["label"] for r in recs} == {"ar", "pld", "recycle:budget=16"}
    md = tmp_path / "report.md"
    r = cli("report", str(out), "--out", str(md), "--plots", str(tmp_path / "plots"), "--command", "X")
    assert r.returncode == 0, r.stderr
    assert "Reproduce: `X`" in md.read_text() and len(list((tmp_path / "plots").glob("*.png"))) == 3
    out.write_text(out.read_text()[:-40])  # a truncated record fails the check
    r = cli("report", str(out))
    assert r.returncode == 1 and "exactness check failed" in r.stderr


def test_lossy_bench_report_and_distortion_on_smollm2(tmp_path, smollm2_engine):
    """Lossy rules are opt-in and labelled end to end: records, the --lossy report with the correct baseline,
    and the distortion tool over real SmolLM2 trees (EAGLE-3 head)."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("Write a haiku about the sea.\n")
    out = tmp_path / "rec.jsonl"
    r = cli("bench", "--prompts", str(prompts), "--methods",
            "eagle:budget=8;eagle:budget=8,verify=lossy:lenience:0.5;eagle:budget=8,min_p=0.3;"
            "eagle:budget=8,verify=lossy:speccascade:0.3", "--dtype", "float32", "--temperature", "0.7",
            "--max-new-tokens", "16", "--out", str(out), "--warmup", "0")
    assert r.returncode == 0, r.stderr
    recs = {x["label"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert recs["eagle:budget=8,verify=lossy:lenience:0.5"]["lossy"] is True
    assert recs["eagle:budget=8,verify=lossy:lenience:0.5"]["verify"] == "lossy:lenience:0.5"
    assert recs["eagle:budget=8"]["lossy"] is False and recs["ar"]["verify"] == "lossless"
    assert recs["eagle:budget=8,min_p=0.3"]["sampling"]["min_p"] == 0.3
    r = cli("report", str(out), "--lossy")
    assert "LOSSY rules vs their correct baselines" in r.stdout
    row = next(x for x in r.stdout.splitlines() if x.startswith("| eagle:budget=8,verify=lossy:speccascade:0.3 |"))
    assert "**lossy**" in row and "| eagle:budget=8,min_p=0.3 |" in row  # paired with its truncation baseline
    dist = tmp_path / "dist.jsonl"
    r = cli("distortion", "--model", "smollm2-135m", "--dtype", "float32", "--modes", "tree", "--prompts",
            str(prompts), "--limit", "1", "--max-new-tokens", "12", "--tree-budget", "8", "--mc-draws", "30",
            "--rules", "lossy:speccascade:0.3;lossy:lenience:0.5;lossy:cos:0.5", "--out", str(dist))
    assert r.returncode == 0, r.stderr
    rows = [x for x in r.stdout.splitlines() if x.startswith("| lossy:")]
    assert len(rows) == 3 and "n/a (needs q)" in next(x for x in rows if "cos" in x)
    rec = json.loads(dist.read_text().splitlines()[0])
    assert rec["mode"] == "tree" and rec["rules"]["lossy:speccascade:0.3"]["n"] > 0
    r = cli("report", str(out), "--study", "--distortion", str(dist))
    assert "a verdict per claim" in r.stdout and "unresolved (missing point" in r.stdout  # tree points only
    row = next(x for x in r.stdout.splitlines() if x.startswith("| eagle:budget=8,verify=lossy:speccascade:0.3 |"))
    assert "| tree |" in row and "| eagle:budget=8,min_p=0.3 |" in row
    r = cli("report", str(out), "--distortion", str(dist))
    assert r.returncode == 2 and "--distortion goes with --study" in r.stderr
