import json

import pytest

from specgraft.eval.datasets import load_dataset, salvage_json_array, shared_data_dir
from specgraft.errors import SpecgraftError


def test_file_loaders(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first\n\nsecond\n")
    items = load_dataset(str(txt))
    assert [it.turns for it in items] == [("first",), ("second",)]
    jl = tmp_path / "q.jsonl"
    jl.write_text(json.dumps({"id": "a", "turns": ["t1", "t2"], "category": "c"}) + "\n"
                  + json.dumps({"prompt": "p", "id": "b"}) + "\n")
    items = load_dataset(str(jl))
    assert items[0].turns == ("t1", "t2") and items[0].category == "c" and items[1].turns == ("p",)
    assert [it.id for it in load_dataset(str(jl), stride=2)] == ["a"]
    assert load_dataset(str(jl), max_turns=1)[0].turns == ("t1",)
    assert [it.id for it in load_dataset(str(jl), categories=["c"])] == ["a"]


def test_bad_sources(tmp_path):
    with pytest.raises(SpecgraftError, match="unknown dataset"):
        load_dataset("nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": 1}\n')
    with pytest.raises(SpecgraftError, match="no prompt field"):
        load_dataset(str(bad))
    bad.write_text('{"prompt": \n')
    with pytest.raises(SpecgraftError, match="not valid JSON"):
        load_dataset(str(bad))


def test_salvage_truncated_array():
    text = '[{"id": "a", "conversations": []}, {"id": "b", "conversations": [{"from": "human", "value": "hi"}]}, {"id": "c", "conv'
    assert [o["id"] for o in salvage_json_array(text)] == ["a", "b"]
    assert salvage_json_array("[]") == []


@pytest.mark.skipif(shared_data_dir() is None, reason="../shared/data not present")
def test_shared_datasets():
    he = load_dataset("humaneval")
    assert len(he) == 164 and he[0].reference["entry_point"] and "```python" in he[0].turns[0]
    mbpp = load_dataset("mbpp")
    assert len(mbpp) == 500 and mbpp[0].id == "11" and mbpp[0].reference["tests"]
    gsm = load_dataset("gsm8k", limit=3)
    assert gsm[0].reference["answer"].lstrip("-").isdigit()
    sg = load_dataset("sharegpt", limit=5)
    assert all(it.turns for it in sg)
