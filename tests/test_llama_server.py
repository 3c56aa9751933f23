"""llama.cpp's own server as an outside reference (``llama_server.py``): its command line and errors, and, with
the binary built by ``scripts/build_llama_server.sh`` (the README's test command builds it), greedy output equal
to llama.cpp AR through our backend in every speculation mode, with the draft model's tokens accepted."""

from __future__ import annotations

import pytest

from specgraft.errors import SpecgraftError

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    from specgraft import Engine

    return Engine("smollm2-135m", backend="llamacpp")


def test_command_line_and_errors(engine, monkeypatch, tmp_path):
    from specgraft import llama_server as LS

    monkeypatch.setenv("SPECGRAFT_LLAMA_SERVER", str(tmp_path / "absent"))
    with pytest.raises(SpecgraftError, match="build_llama_server.sh"):
        LS.server_argv(engine, "none", "", "")
    fake = tmp_path / "llama-server"
    fake.write_text("")
    monkeypatch.setenv("SPECGRAFT_LLAMA_SERVER", str(fake))
    argv = LS.server_argv(engine, "ngram-mod", "", "--spec-ngram-mod-n-max 16")
    assert argv[:3] == [str(fake), "-m", str(engine.backend.model.path)]
    assert argv[argv.index("--spec-type") + 1] == "ngram-mod" and argv[-2:] == ["--spec-ngram-mod-n-max", "16"]
    assert argv[argv.index("-np") + 1] == "1" and "--no-cache-prompt" in argv
    with pytest.raises(SpecgraftError, match="unknown spec"):
        LS.server_argv(engine, "medusa", "", "")
    with pytest.raises(SpecgraftError, match="draft_model"):
        LS.server_argv(engine, "draft-simple", "", "")
    with pytest.raises(SpecgraftError, match="draft_model"):
        LS.server_argv(engine, "ngram-mod", "smollm2-135m", "")


def test_refused_on_transformers():
    from specgraft import Engine

    with pytest.raises(SpecgraftError, match="llamacpp"):
        Engine("smollm2-135m").generate("hi", "llama_server")


from .test_smollm2 import PROMPTS  # noqa: E402

SPECS = [("none", {}), ("ngram-mod", {"args": "--spec-ngram-mod-n-min 2 --spec-ngram-mod-n-max 8"}),
         ("ngram-simple", {}), ("draft-simple", {"draft_model": "smollm2-135m"})]


def test_greedy_equals_llamacpp_ar(engine):
    from specgraft.llama_server import binary

    try:
        binary()
    except SpecgraftError as err:
        pytest.skip(str(err))
    accepted = {}
    for prompt in PROMPTS[:4]:
        ref = engine.generate(prompt, "ar", max_new_tokens=96)
        for spec, opts in SPECS:
            g = engine.generate(prompt, "llama_server", max_new_tokens=96, spec=spec, **opts)
            assert g.token_ids == ref.token_ids, (spec, prompt[:30])
            accepted[spec] = accepted.get(spec, 0) + g.stats.new_tokens - g.stats.steps
    assert accepted["none"] == 0 and accepted["draft-simple"] > 100, accepted  # the draft model's tokens count
