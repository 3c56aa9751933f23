"""``specgraft report`` statistics on synthetic records: bootstrap intervals, per-prompt table, goals, noise
pairs, provenance, and the CLI options."""

import json
import subprocess
import sys

import numpy as np
import pytest

from specgraft.eval import report_stats as rs
from specgraft.errors import SpecgraftError
from specgraft.eval.report import Report, exactness, markdown, unchecked


def make_record(label, prompt_id, *, tok_s=10.0, mat=1.0, tokens=100, turn=0, n_turns=1, seed=0, dataset="ds",
                spec=None, commit="abc1234", dirty=False, calibration_info=None):
    """A harness-shaped record: ``tokens`` new tokens at ``tok_s`` tokens/s with ``mat`` tokens per step."""
    steps = max(1, round(tokens / mat))  # AR: one token per step
    extra = tokens - (tokens // steps) * steps if steps else 0
    accepts = [tokens // steps - 1 + (j < extra) for j in range(steps)]  # sum(a + 1) == tokens
    drafter = {"method": label.split(":")[0]}
    if calibration_info is not None:
        drafter["calibration_info"] = calibration_info
    wall = tokens / tok_s
    rec = {"schema": 1, "dataset": dataset, "prompt_id": str(prompt_id), "category": "c", "turn": turn,
           "n_turns": n_turns, "seed": seed, "label": label, "method": label.split(":")[0],
           "method_config": {"drafter": drafter}, "model": "m", "dtype": "float32", "max_new_tokens": 256,
           "sampling": {"temperature": 0.0}, "greedy": True, "lossy": False,
           "machine": {"cpu": "cpu", "cores": 2, "threads": 2}, "versions": {}, "commit": commit, "dirty": dirty,
           "prompt_tokens": 10, "output_ids": list(range(tokens)), "text": "", "new_tokens": tokens,
           "steps": steps, "accept_lengths": accepts, "mat": mat, "depth_trials": [], "depth_accepts": [],
           "tree_nodes": 0, "wall_s": wall, "prefill_s": 0.0, "draft_s": 0.0, "verify_s": wall, "other_s": 0.0,
           "retrieval_state": None}
    if spec is not None:
        rec["spec"] = spec
    return rec


def make_run(n_prompts, speedups, *, noise=0.0, seed=0, **kw):
    """AR at 10 tok/s plus one label per entry of ``speedups`` ({label: speedup}) on ``n_prompts`` prompts;
    each prompt's speed gets a multiplicative log-normal ``noise``."""
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n_prompts):
        recs.append(make_record("ar", i, tok_s=10.0, **kw))
        for label, sp in speedups.items():
            recs.append(make_record(label, i, tok_s=10.0 * sp * float(np.exp(rng.normal(0, noise))), mat=2.0, **kw))
    return recs


def report_of(recs):
    labels = list(dict.fromkeys(r["label"] for r in recs))
    if "ar" in labels:
        labels.remove("ar")
        labels.insert(0, "ar")
    mm, missing = exactness(recs, labels)
    return Report(recs, [], labels, mm, missing, unchecked(recs, labels))


def test_interval_contains_point_and_shrinks_with_more_prompts():
    widths = []
    for n in (10, 250):
        est = rs.speedup_ci(rs.per_prompt(make_run(n, {"m": 1.5}, noise=0.3)), "m", "ar")
        assert est.n == n and est.lo <= est.point <= est.hi and est.lo < est.hi
        widths.append(est.hi - est.lo)
    assert widths[1] < widths[0] / 2


def test_interval_is_the_point_when_prompts_are_identical():
    est = rs.speedup_ci(rs.per_prompt(make_run(8, {"m": 1.6})), "m", "ar")
    assert est.point == pytest.approx(1.6) and est.lo == pytest.approx(1.6) and est.hi == pytest.approx(1.6)
    mat = rs.mat_ci(rs.per_prompt(make_run(8, {"m": 1.6})), "m")
    assert (mat.point, mat.lo, mat.hi) == pytest.approx((2.0, 2.0, 2.0))


def test_statistic_is_ratio_of_sums_and_deterministic():
    # Two prompts: one long and fast, one short and slow; the ratio of sums weights by time.
    recs = [make_record("ar", 0, tokens=100), make_record("m", 0, tokens=100, tok_s=40.0),
            make_record("ar", 1, tokens=10), make_record("m", 1, tokens=10, tok_s=5.0)]
    pp = rs.per_prompt(recs)
    est = rs.speedup_ci(pp, "m", "ar")
    t_ar, t_m = 10.0 + 1.0, 2.5 + 2.0
    assert est.point == pytest.approx(t_ar / t_m)
    assert est == rs.speedup_ci(pp, "m", "ar")  # fixed seed


def test_turns_of_a_conversation_resample_together_and_only_paired_keys_count():
    recs = []
    for i in range(5):
        for t in range(2):
            recs.append(make_record("ar", i, turn=t, n_turns=2))
            recs.append(make_record("m", i, turn=t, n_turns=2, tok_s=20.0))
    recs.append(make_record("m", 99, tok_s=1000.0))  # no AR record for this prompt: not paired
    pp = rs.per_prompt(recs)
    assert len(pp["ar"]) == 5 and pp["m"][("ds", "0", 0)].tokens == 200
    est = rs.speedup_ci(pp, "m", "ar")
    assert est.n == 5 and est.point == pytest.approx(2.0)


def test_per_prompt_table_has_one_row_per_prompt():
    recs = make_run(4, {"a": 1.2, "b": 2.0}) + make_run(4, {"a": 1.2, "b": 2.0}, seed=1, dataset="other")
    lines = rs.prompt_table(rs.per_prompt(recs), ["ar", "a", "b"])
    rows = [x for x in lines if x.startswith("| ds/") or x.startswith("| other/")]
    assert len(rows) == 8
    assert "| a | b |" in lines[3] and "1.20x / 2.00" in rows[0] and "2.00x / 2.00" in rows[0]


def test_goal_met_only_when_lower_bound_clears():
    recs = make_run(12, {"new": 1.3, "old": 1.0}, noise=0.2)
    pp = rs.per_prompt(recs)
    est = rs.speedup_ci(pp, "new", "old")
    assert est.lo < est.point
    met = rs.goal_lines(pp, [rs.parse_goal(f"new>old:{est.lo - 0.01:.4f}")])[-1]
    assert met.endswith("**met**")
    between = (est.lo + est.point) / 2  # the point clears it, the lower bound does not
    miss = rs.goal_lines(pp, [rs.parse_goal(f"new>old:{between:.4f}")])[-1]
    assert f"not met (lower bound {est.lo:.3f})" in miss
    mat = rs.goal_lines(pp, [rs.parse_goal("mat:new>ar:2")])[-1]
    assert "MAT ratio" in mat and mat.endswith("**met**")


@pytest.mark.parametrize("text", ["graft>eagle", "graft:1.1", "a>b>c:1.2", ">b:1.1", "a>:1.1", "a>b:x", "a>b:-1",
                                  "a>b:nan"])
def test_bad_goal_strings(text):
    with pytest.raises(SpecgraftError, match="bad --goal"):
        rs.parse_goal(text)


def test_goal_parsing_with_colons_in_labels():
    g = rs.parse_goal("graft:budget=15>eagle:budget=15:1.15")
    assert (g.label, g.ref, g.ratio, g.metric) == ("graft:budget=15", "eagle:budget=15", 1.15, "speed")
    g = rs.parse_goal("mat:graft>ar:1")
    assert (g.label, g.ref, g.metric) == ("graft", "ar", "mat")
    with pytest.raises(SpecgraftError, match="unknown label 'nope'"):
        rs.check_labels(["ar", "graft"], None, [rs.parse_goal("nope>ar:1")])
    with pytest.raises(SpecgraftError, match="unknown reference label 'x'"):
        rs.check_labels(["ar", "graft"], "x", [])


def test_noise_pairs_detected_by_spec():
    same = {"method": "graft", "options": {"budget": 15}, "verify": "lossless", "sampling": {"temperature": 0}}
    other = {**same, "options": {"budget": 8}}
    recs = []
    for i in range(6):
        recs += [make_record("ar", i, spec={"method": "ar", "options": {}}),
                 make_record("g1", i, tok_s=15.0, spec=same), make_record("g2", i, tok_s=15.0 * (1 + i / 100),
                                                                          spec=dict(reversed(same.items()))),
                 make_record("g8", i, spec=other), make_record("nospec", i)]
    labels = ["ar", "g1", "g2", "g8", "nospec"]
    assert rs.noise_pairs(recs, labels) == [("g1", "g2")]
    lines = rs.noise_lines(rs.per_prompt(recs), rs.noise_pairs(recs, labels))
    row = next(x for x in lines if x.startswith("| g2 vs g1"))
    assert "| 6 |" in row and "1.02x [" in row
    assert rs.noise_pairs([r for r in recs if "spec" not in r or r["label"] == "g1"], labels) == []
    assert "Measured noise" in markdown(report_of(recs))


def test_markdown_sections_provenance_and_calibration():
    info = {"source": "sharegpt", "skip": 64, "rounds": 4, "observations": {"0": 120, "1": 80}, "fallback": False}
    recs = make_run(5, {"g": 1.5, "e": 1.2}, commit="deadbee", dirty=True)
    for r in recs:
        if r["label"] == "g":
            r["method_config"]["drafter"]["calibration_info"] = info
    md = markdown(report_of(recs), reference="e", goals=["g>e:1.2", "g>ar:1.4"])
    assert "deadbee (dirty tree" in md
    assert "| all | g | 5 | 1.50x [1.50, 1.50] | 1.25x [1.25, 1.25] | 2.00 [2.00, 2.00] |" in md
    assert "`g>e:1.2`" in md and md.count("**met**") == 2
    cal = md.split("## Calibration")[1].split("##")[0]
    assert "- g: source: sharegpt, skip: 64, rounds: 4" in cal and '{"0": 120, "1": 80}' in cal and "- e" not in cal
    assert "| all | ar |" in md and "## Per prompt" in md


def test_no_ar_records_still_reports():
    recs = [make_record("m", i) for i in range(3)] + [make_record("n", i, tok_s=12.0) for i in range(3)]
    md = markdown(Report(recs, [], ["m", "n"], {}, []), reference="m")
    assert "n/a (no AR)" in md and "| all | n | 3 | n/a (no AR) | 1.20x [1.20, 1.20] |" in md


def cli(*args):
    return subprocess.run([sys.executable, "-m", "specgraft", *args], capture_output=True, text=True, timeout=120)


def test_cli_reference_and_goals(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in make_run(6, {"graft:budget=15": 1.5, "eagle": 1.2},
                                                                     noise=0.1)))
    r = cli("report", str(path), "--reference", "eagle", "--goal", "graft:budget=15>eagle:1.0",
            "--goal", "mat:eagle>ar:1.5")
    assert r.returncode == 0, r.stderr
    assert "speedup vs eagle [95% CI]" in r.stdout and "## Goals" in r.stdout and r.stdout.count("**met**") == 2
    for args, message in [(["--goal", "graft>eagle"], "bad --goal 'graft>eagle'"),
                          (["--reference", "nope"], "unknown reference label 'nope'"),
                          (["--goal", "graft>eagle:1.1"], "unknown label 'graft'")]:
        r = cli("report", str(path), *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
        assert not r.stdout.strip()


def per_backend_run(diverge: str):
    """Two ARs (one per backend) and a method on each; ``diverge`` names the method whose output differs."""
    recs = []
    for i in range(4):
        for label, backend, dtype in (("llama-ar", "llamacpp", "gguf"), ("llama-pld", "llamacpp", "gguf"),
                                      ("int4-ar", "transformers", "int4"), ("int4-pld", "transformers", "int4")):
            r = make_record(label, i)
            r.update(method=label.split("-")[1], backend=backend, dtype=dtype)
            if label == diverge and i == 2:
                r["output_ids"] = r["output_ids"][:7] + [999] + r["output_ids"][8:]
            recs.append(r)
    return recs


@pytest.mark.parametrize("diverge", ["int4-pld", "llama-pld"])
def test_each_method_is_checked_against_the_ar_of_its_own_backend(diverge):
    rep = report_of(per_backend_run(diverge))
    assert rep.mismatches == {diverge: [(("ds", "2", 0, 0), 7)]} and rep.unchecked == []
    md = markdown(rep)
    assert f"- {diverge} vs {diverge.split('-')[0]}-ar: 1 of 4 differ (first divergence at tokens [7])" in md
    other = "llama-pld" if diverge == "int4-pld" else "int4-pld"
    assert f"- {other} vs {other.split('-')[0]}-ar: identical" in md


def test_a_method_without_an_ar_on_its_weights_is_not_checked_never_identical():
    recs = [r for r in per_backend_run("int4-pld") if r["label"] != "int4-ar"]
    rep = report_of(recs)
    assert rep.unchecked == ["int4-pld"] and "int4-pld" not in rep.mismatches
    md = markdown(rep)
    assert "- int4-pld: not checked (no AR ran on its backend and weights)" in md
    assert "int4-pld vs" not in md and "- int4-pld: identical" not in md


def test_tables_divide_by_the_runs_ar_when_it_is_not_labelled_ar():
    """A run whose AR is labelled ``llama-ar`` (no ``ar`` label): the tables' speedups are vs it, or vs
    ``--reference``; they were all NaN before."""
    recs = []
    for i in range(3):
        for label, tok_s in (("llama-ar", 10.0), ("llama-pld", 15.0), ("server", 20.0)):
            r = make_record(label, i, tok_s=tok_s)
            r.update(method="ar" if label == "llama-ar" else label)
            recs.append(r)
    rep = Report(recs, [], ["llama-ar", "llama-pld", "server"], {}, [])
    md = markdown(rep)
    assert "speedup vs llama-ar |" in md and "| all | llama-pld | 3 | 300 | 15.00 | 1.50x |" in md
    assert "nanx" not in md
    assert "| all | llama-pld | 3 | 1.50x [1.50, 1.50] |" in md  # the interval table's AR column too
    assert "| prompt | llama-ar tok/s | llama-pld | server |" in md and "| 1.50x / 1.00 | 2.00x / 1.00 |" in md
    md = markdown(rep, reference="server")
    assert "speedup vs server |" in md and "| all | llama-ar | 3 | 300 | 10.00 | 0.50x |" in md


def test_sampled_labels_are_not_called_identical_and_a_cut_run_is_incomplete_not_failed():
    """Token equality is a greedy-lossless check: a sampled label gets 'not checked (sampled ...)', even when its
    ids happen to equal AR's; a key a label lacks (a cut run) is listed as incomplete, not as a FAIL."""
    recs = make_run(3, {"pld": 1.5})
    for r in recs:
        if r["label"] == "pld":
            r["greedy"] = False
    recs = [r for r in recs if not (r["label"] == "pld" and r["prompt_id"] == "2")]
    rep = report_of(recs)
    md = markdown(rep)
    assert "- pld: not checked (sampled or lossy" in md and "pld vs ar: identical" not in md
    assert "## Incomplete" in md and "- pld has no record for ('ds', '2', 0, 0)" in md and "FAIL" not in md
    assert not rep.ok
    greedy = make_run(3, {"pld": 1.5})
    assert "- pld vs ar: identical" in markdown(report_of(greedy))  # the control: greedy is still checked


def test_the_header_lists_every_machine_a_resumed_file_mixes():
    recs = make_run(2, {"pld": 1.5})
    assert sum(line.startswith("- machine") for line in markdown(report_of(recs)).splitlines()) == 1
    for r in recs[:2]:
        r["machine"] = {"cpu": "Intel Xeon", "cores": 2, "threads": 2, "amx": "present", "isa": "amx_bf16"}
    md = markdown(report_of(recs))
    assert "- machines (records were written on several" in md
    assert "  - Intel Xeon, 2 cores, 2 threads, AMX present, vector ISA amx_bf16; versions: {} (2 records)" in md
    assert "  - cpu, 2 cores, 2 threads, AMX not recorded, vector ISA not recorded; versions: {} (2 records)" in md


def test_a_batched_run_says_how_its_times_read():
    recs = make_run(2, {"pld": 1.5})
    assert "Batched groups" not in markdown(report_of(recs))
    for r in recs:
        r["batch"] = {"size": 4, "group": 0, "id": "x", "in_flight": 2, "wall_s": 1.0, "invariant": False}
    assert "- Batched groups of 4 conversations: each turn's time is its latency" in markdown(report_of(recs))
