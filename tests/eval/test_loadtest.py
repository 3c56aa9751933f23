"""The load generator's request bodies and aggregation (eval/loadtest.py), on synthetic records; the live path
runs against the tiny engine."""

import pytest

from specgraft.eval.loadtest import cell_order, prompt_table, request_body, run_loadtest, summary, table
from specgraft.serve.app import Server

from ..serve.live import Live


def test_request_body_from_a_method_spec():
    body = request_body("graft:budget=7,drafter=draft-tree", "hi", 32)
    assert body["method"] == "graft" and body["budget"] == 7 and body["options"] == {"drafter": "draft-tree"}
    assert body["temperature"] == 0 and body["stream"] and body["max_tokens"] == 32
    assert "budget" not in request_body("ar", "hi", 8) and "options" not in request_body("ar", "hi", 8)
    assert "method" not in request_body("auto", "hi", 8)  # the server's default (its --method auto choice)


def test_each_concurrency_changes_its_leading_method_every_round():
    # four methods and four concurrencies: rotating by the number of cells run so far (a multiple of four at every
    # group's start) would put AR first in every group, carrying the machine's drift into every ratio
    methods, concs = ["ar", "pld", "graft", "auto"], [1, 4, 8, 16]
    order = cell_order(methods, concs, 4)
    assert len(order) == 64 and len(set(order)) == 64
    for c in concs:
        leads = [order[i][2] for i in range(0, 64, 4) if order[i][1] == c]
        assert sorted(leads) == sorted(methods)  # each method leads each concurrency once in four rounds
    group = [m for r, c, m in order if (r, c) == (1, 4)]
    assert group == ["graft", "auto", "ar", "pld"]  # round 1, second concurrency: rotated by two


def records():
    base = {"model": "m", "concurrency": 2}
    out = []
    for method, e2e in (("ar", 2.0), ("pld", 1.0)):
        for rnd in (0, 1):
            for p in ("a", "b"):
                out.append({**base, "kind": "request", "method": method, "round": rnd, "prompt": p, "e2e_s": e2e,
                            "ttft_s": 0.1, "itl_s": [0.05, 0.05], "tokens": 10, "steps": 4 if method == "pld" else 9,
                            "error": None})
            out.append({**base, "kind": "cell", "method": method, "round": rnd, "wall_s": e2e, "tokens": 20,
                        "errors": 0})
    out.append({**base, "kind": "request", "method": "pld", "round": 1, "prompt": "c", "e2e_s": 9.0, "ttft_s": None,
                "itl_s": [], "tokens": 0, "steps": None, "error": "HTTP 429"})
    return out


def test_summary_ratios_errors_and_mat():
    rows = {r["method"]: r for r in summary(records())}
    ar, pld = rows["ar"], rows["pld"]
    assert ar["tok_per_s"] == pytest.approx(10.0) and pld["tok_per_s"] == pytest.approx(20.0)
    assert pld["throughput_ratio"] == pytest.approx(2.0) and pld["speedup"] == pytest.approx(2.0)
    assert pld["speedup_ci"] == [pytest.approx(2.0), pytest.approx(2.0)]  # identical pairs: no spread
    assert pld["errors"] == 1 and ar["errors"] == 0 and pld["requests"] == 5
    assert pld["mat"] == pytest.approx(9 / 4) and ar["mat"] == pytest.approx(1.0)
    assert pld["ttft_p50"] == pytest.approx(0.1) and pld["itl_p99"] == pytest.approx(0.05)
    assert "| m | 2 | pld |" in table(list(rows.values()))
    per = prompt_table(records(), 2).splitlines()
    assert per[0] == "| prompt | ar s/token | pld s/token (vs AR) |" and len(per) == 4  # a, b; c failed
    assert per[2] == "| a | 0.200 | 0.100 (2.00x) |"


def test_requests_shed_to_ar_are_counted_per_cell():
    recs = records()
    for r in recs:
        if r["kind"] == "request" and r["method"] == "pld" and r["prompt"] == "a":
            r["ran"], r["shed_from"] = "ar", "pld"
    rows = {r["method"]: r for r in summary(recs)}
    assert rows["pld"]["shed"] == 2 and rows["ar"]["shed"] == 0
    assert "(2 shed to AR)" in table(list(rows.values())) and "(0 shed" not in table(list(rows.values()))


def test_a_live_run_measures_and_resumes(tiny_engine, tmp_path):
    server = Server.start(tiny_engine, method="ar", max_num_seqs=4, batch_budget=False)
    out = tmp_path / "load.jsonl"
    with Live(server) as url:
        recs = run_loadtest(url, ["ar", "pld"], [("p1", "Tell me a story."), ("p2", "Count to ten.")], [1, 2], 1,
                            12, out, {"model": "tiny"}, log=lambda s: None)
        cells = [r for r in recs if r["kind"] == "cell"]
        assert len(cells) == 4 and all(c["errors"] == 0 for c in cells)
        assert all(1 <= r["tokens"] <= 12 and r["ttft_s"] > 0 for r in recs if r["kind"] == "request")
        again = run_loadtest(url, ["ar", "pld"], [("p1", "x"), ("p2", "y")], [1, 2], 1, 12, out, {"model": "tiny"},
                             log=lambda s: None)
    assert len(again) == len(recs)  # every cell was done: nothing re-run
