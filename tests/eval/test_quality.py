from specgraft.eval.quality import extract_code, gsm8k_extract, humaneval_program, run_sandboxed, score


def test_sandbox_passes_and_fails():
    assert run_sandboxed("assert 1 + 1 == 2").passed
    r = run_sandboxed("assert 1 + 1 == 3")
    assert not r.passed and r.status == "failed" and "AssertionError" in r.detail


def test_infinite_loop_is_contained():
    r = run_sandboxed("while True:\n    pass\n", timeout_s=2)
    assert r.status == "timeout" and not r.passed


def test_harmful_calls_are_contained(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for prog in (f"import os\nos.remove({str(victim)!r})",
                 f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
                 f"import os\nos.system('rm -f {victim}')",
                 f"import subprocess\nsubprocess.run(['rm', '-f', {str(victim)!r}])",
                 "import socket\nsocket.create_connection(('127.0.0.1', 80))",
                 "import socket\nsocket.socket()"):
        r = run_sandboxed(prog, timeout_s=5)
        assert not r.passed and "blocked" in r.detail, (prog, r)
    assert victim.read_text() == "keep me"


def test_memory_bomb_is_contained():
    r = run_sandboxed("x = bytearray(4 << 30)", timeout_s=5, mem_mb=512)
    assert not r.passed and "MemoryError" in r.detail


def test_humaneval_scoring_full_function_and_body():
    ref = {"prompt": "from typing import List\n\ndef add(a: int, b: int) -> int:\n    \"\"\"Add.\"\"\"\n",
           "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n", "entry_point": "add"}
    good = "Here you go:\n```python\ndef add(a: int, b: int) -> int:\n    return a + b\n```\n"
    assert score("humaneval", ref, good)["value"] == 1.0
    assert score("humaneval", ref, "```python\n    return a + b\n```")["value"] == 1.0
    assert score("humaneval", ref, "```python\ndef add(a, b):\n    return a - b\n```")["value"] == 0.0
    assert "check(add)" in humaneval_program(ref, good)


def test_mbpp_and_gsm8k():
    ref = {"tests": ["assert sq(3) == 9"], "setup": ""}
    assert score("mbpp", ref, "```python\ndef sq(x):\n    return x * x\n```")["value"] == 1.0
    assert score("mbpp", ref, "```python\ndef sq(x):\n    return x\n```")["value"] == 0.0
    assert gsm8k_extract("3 + 4 = 7. The answer is 1,234.") == "1234"
    assert gsm8k_extract("so 12 apples and then 18") == "18"
    assert gsm8k_extract("no numbers") is None
    assert score("gsm8k", {"answer": "18"}, "We get 18.0 in total")["value"] == 1.0
    assert score("mtbench", {}, "anything") is None


def test_extract_code_unterminated_block():
    assert extract_code("text\n```python\nx = 1\n").strip() == "x = 1"
    assert extract_code("```python\na = 1\n```\nand\n```python\nlonger = 2\n```").strip() == "longer = 2"
    assert extract_code("plain") == "plain"
