"""Linear layers prepacked for oneDNN, bf16 and fp32 (``backends/packed.py``): a packed layer must compute what the
plain layer computes, a packed model must give the plain model's logits and greedy text, a tied head must get its
own copy without touching the embedding, and the cost curve's key must tell packed from plain layers.

Where the plain layer also runs oneDNN (bf16 on the AMX machine of docs/benchmarks.md) the two are bit-equal; on
another CPU a plain product may take another kernel (PyTorch picks by shape and ISA; fp32 on an AVX2 EPYC sums in
another order), so the checks allow a few roundings of the output's dtype, and greedy text may part only at a
near-tie (the backend's declared tie gap). bf16 cases run where this CPU has oneDNN's packed bf16 path."""

from __future__ import annotations

import pytest
import torch

from specgraft.backends import packed
from specgraft.core.backend import TargetBackend, head_rows, packed_layers

from ..conftest import assert_greedy_equal, tiny_llama

# the tolerance, relative to the output's largest value: one bf16 rounding; fp32 sums of ~100 products in
# another order part by a few fp32 roundings (a 2^-17 bound is still 2^6 times tighter than one bf16 rounding)
STEP = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -17}
DTYPES = [pytest.param(torch.float32, id="fp32"),
          pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
              not packed.available(torch.bfloat16), reason="no packed bf16 path on this CPU (AVX2 only: "
              "tests/backends/test_packed_fallback.py)"))]


def assert_within_one_rounding(a: torch.Tensor, b: torch.Tensor) -> None:
    step = STEP[b.dtype]
    a, b = a.detach().float(), b.detach().float()
    assert float((a - b).abs().max()) <= step * float(b.abs().max())

pytestmark = pytest.mark.skipif(not packed.available(torch.float32), reason="this PyTorch has no oneDNN linear ops")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_layer_equals_the_plain_layer_within_a_rounding(bias, dtype):
    torch.manual_seed(0)
    plain = torch.nn.Linear(96, 80, bias=bias).to(dtype)
    layer = packed.PackedLinear(plain.weight, plain.bias, dtype)
    assert (layer.in_features, layer.out_features) == (96, 80)
    for rows in (1, 2, 3, 4, 7, 16):
        x = torch.randn(2, rows, 96).to(dtype)
        y = layer(x)
        assert y.shape == (2, rows, 80) and y.dtype == dtype
        assert_within_one_rounding(y, plain(x))
    # negative control: one weight moved is seen
    w = plain.weight.detach().clone()
    w[5, 7] += 8 * w.abs().max()
    moved = packed.PackedLinear(w, plain.bias, dtype)
    x = torch.randn(4, 96).to(dtype)
    with pytest.raises(AssertionError):
        assert_within_one_rounding(moved(x), plain(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_model_gives_the_plain_models_logits_and_keeps_its_embedding(dtype):
    plain = tiny_llama(vocab=64, layers=2).to(dtype)
    model = tiny_llama(vocab=64, layers=2).to(dtype)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2 and Qwen2.5-1.5B are
    plain.lm_head.weight = plain.model.embed_tokens.weight
    model.config.tie_word_embeddings = plain.config.tie_word_embeddings = True
    table = model.model.embed_tokens.weight.detach().clone()
    swapped = packed.prepack(model)
    assert len(swapped) == 2 * 7 + 1  # every projection of every layer, and the head
    assert isinstance(model.lm_head, packed.PackedLinear) and not model.config.tie_word_embeddings
    assert torch.equal(model.model.embed_tokens.weight, table)  # the gathers still read the table
    assert packed_layers(model) == 15 and packed_layers(plain) == 0 and head_rows(model) == 64
    ids = torch.randint(1, 63, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert_within_one_rounding(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    # through the backend: a tree verify after a prefill, packed against plain
    from specgraft.core.tree import Tree

    outs = []
    for m in (model, plain):
        be = TargetBackend(m)
        be.prefill(ids[0])
        outs.append(be.verify(Tree.chain(int(ids[0, -1]), [3, 4, 5, 6])).logits)
    assert_within_one_rounding(*outs)


def test_the_curve_key_tells_packed_layers_from_plain_ones(monkeypatch):
    model = tiny_llama(vocab=64, layers=1)
    plain_runtime = TargetBackend(model).capabilities.runtime
    assert "prepacked" not in plain_runtime
    packed.prepack(model)  # fp32: laid out for 16 rows, its own curve
    assert TargetBackend(model).capabilities.runtime == plain_runtime + "|prepacked16"
    one_row = tiny_llama(vocab=64, layers=1)
    packed.prepack(one_row, hint=1)  # the first layout keeps the key its cached curves were measured under
    assert TargetBackend(one_row).capabilities.runtime == plain_runtime + "|prepacked"
    monkeypatch.setenv("SPECGRAFT_PREPACK", "0")  # the switch for measuring plain layers
    assert not packed.available(torch.float32) and packed.prepack(tiny_llama(layers=1)) == []


def test_fp16_and_integer_layers_are_left_as_they_are():
    model = tiny_llama(layers=1).to(torch.float16)  # no packed path asked for
    assert packed.prepack(model) == [] and packed_layers(model) == 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [pytest.param("float32", id="fp32"), pytest.param("bfloat16", id="bf16", marks=(
    pytest.mark.skipif(not packed.available(torch.bfloat16), reason="no packed bf16 path on this CPU")))])
def test_smollm2_loads_packed_and_decodes_as_the_plain_model(monkeypatch, dtype):
    from specgraft import Engine

    fast = Engine("smollm2-135m", dtype)
    assert "prepacked" in fast.capabilities.runtime
    assert isinstance(fast.backend.model.get_output_embeddings(), packed.PackedLinear)
    monkeypatch.setenv("SPECGRAFT_PREPACK", "0")
    plain = Engine("smollm2-135m", dtype)
    assert "prepacked" not in plain.capabilities.runtime
    prompt = "Write a Python function that removes duplicates from a list."
    gap = plain.capabilities.tie_gap
    for method in ("ar", "pld"):
        ref = plain.generate(prompt, method, max_new_tokens=32)
        assert_greedy_equal(plain, ref, fast.generate(prompt, method, max_new_tokens=32), f"packed {method}", gap=gap)
