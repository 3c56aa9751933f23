"""The fuzzer (fuzz.py) in CI: a bounded count of generated requests against live SmolLM2 beside good greedy
requests. The long run (>= 5,000 requests) is in docs/serving.md, Hardening."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis_jsonschema")

from specgraft.serve.app import Server, create_app  # noqa: E402

from ..test_smollm2 import PROMPTS  # noqa: E402
from .fuzz import MAX_FUZZ_TOKENS, fuzz  # noqa: E402
from .live import Live  # noqa: E402

N_FUZZ = 100
GOOD_TOKENS = 12


@pytest.mark.slow
def test_generated_requests_never_break_the_server(smollm2_engine):
    engine = smollm2_engine
    solo = {p: engine.generate(p, "ar", max_new_tokens=GOOD_TOKENS).text for p in PROMPTS[:4]}
    server = Server.start(engine, method="graft", max_num_seqs=8, max_queue=128, max_tokens=MAX_FUZZ_TOKENS)
    with Live(server) as url:
        tally = fuzz(url, create_app(server).openapi(), N_FUZZ, solo, GOOD_TOKENS)
        assert server.runner.wait_for(lambda: not engine.active and not server.runner.running, 120)
        assert server.runner.alive, server.runner.error
    print("fuzz tally:", tally)
    assert tally["requests"] >= N_FUZZ // 2, tally  # hypothesis may stop early once the space is exhausted
    assert all(s < 500 for s in tally["statuses"]), tally
    assert 200 in tally["statuses"] and 400 in tally["statuses"], tally  # both paths were exercised
    assert tally["good_sent"] >= 1 and tally["good_equal_solo"] == tally["good_sent"], tally["good_failures"]
    assert engine.backend.rows == 0
