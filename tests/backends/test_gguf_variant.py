"""``--dtype gguf-q8`` (``backends/gguf_variant.py``) on SmolLM2's GGUF (Q4_1, which has no batched x86 kernel):
the copy re-quantises exactly the tensors without one and copies the rest, is made once and named after its
original, stays close to the original, says what it runs, and keeps the lossless contract on itself."""

from __future__ import annotations

import shutil

import pytest
import torch

from specgraft.errors import SpecgraftError

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    from specgraft.backends.gguf_variant import batched_variant
    from specgraft.models import gguf_file

    folder = tmp_path_factory.mktemp("gguf")
    original = folder / "smollm2.gguf"
    shutil.copy(gguf_file("smollm2-135m")[0], original)
    return original, batched_variant(original, folder / "cache")


def test_only_tensors_without_a_batched_kernel_change(variant):
    from specgraft.backends.gguf_variant import BATCHED_TYPES, GGML_TYPE_Q8_0, _tensor_types

    original, copy = variant
    before, after = _tensor_types(original), _tensor_types(copy)
    assert before.keys() == after.keys() and copy.parent == original.parent and "gguf-q8-" in copy.name
    changed = {n for n in before if before[n] != after[n]}
    assert changed == {n for n, t in before.items() if t not in BATCHED_TYPES} and len(changed) > 100
    assert all(after[n] == GGML_TYPE_Q8_0 for n in changed)
    from gguf import GGUFReader

    old = {t.name: t for t in GGUFReader(str(original)).tensors}
    for t in GGUFReader(str(copy)).tensors:  # every tensor that keeps its type is copied byte for byte
        if t.name not in changed:
            assert bytes(t.data.tobytes()) == bytes(old[t.name].data.tobytes()), t.name


def test_made_once_and_refused_when_nothing_would_change(variant, capsys):
    from specgraft.backends.gguf_variant import batched_variant

    original, copy = variant
    stamp = copy.stat().st_mtime_ns
    assert batched_variant(original, original.parent / "cache") == copy and copy.stat().st_mtime_ns == stamp
    with pytest.raises(SpecgraftError, match="already takes llama.cpp's batched kernels"):
        batched_variant(copy, original.parent / "cache")
    assert not [p for p in original.parent.iterdir() if p.name.endswith(".tmp")]  # no half-written file


def test_close_to_the_original_and_lossless_on_itself(capsys):
    from specgraft import Engine

    q8 = Engine("smollm2-135m", "gguf-q8", backend="llamacpp")
    assert "not the original file" in capsys.readouterr().err and q8.backend.capabilities.weights == "gguf-q8"
    plain = Engine("smollm2-135m", backend="llamacpp")
    ref = plain.generate("Write a SQL query that lists the ten customers with the highest total order value.",
                         "ar", max_new_tokens=64)
    ids = ref.prompt_ids + ref.token_ids[:-1]
    pred = q8.backend.clone().prefill(torch.tensor(ids), all_logits=True).logits[len(ref.prompt_ids) - 1:].argmax(-1)
    assert float((pred == torch.tensor(ref.token_ids)).float().mean()) > 0.9  # Q8_0 holds Q4_1's values closely
    own = q8.generate("Count from one to twenty in words.", "ar", max_new_tokens=48)
    for method, opts in (("pld", {"budget": 3}), ("graft", {"budget": 8})):
        assert q8.generate("Count from one to twenty in words.", method, max_new_tokens=48,
                           **opts).token_ids == own.token_ids, method
