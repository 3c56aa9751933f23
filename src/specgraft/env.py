"""Where a measurement ran: CPU, threads, library versions, commit and whether the tree was dirty."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import subprocess
from pathlib import Path

import torch
import transformers


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "specgraft": md.version("specgraft"),
            "commit": git("rev-parse", "--short", "HEAD") or None, "dirty": None if status is None else bool(status)}
