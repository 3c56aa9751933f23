"""bf16 linear layers prepacked for oneDNN (``backends/packed.py``): a packed layer must compute what the plain
layer computes, a packed model must give the plain model's logits and greedy text, a tied head must get its own
copy without touching the embedding, and the cost curve's key must tell packed from plain layers.

Where the plain layer also runs oneDNN (bf16 on the AMX machine of docs/benchmarks.md) the two are bit-equal; on
another CPU a plain bf16 product may take another kernel (PyTorch picks by shape and ISA), so the checks allow one
bf16 rounding of the output, and greedy text may part only at a near-tie (the backend's declared tie gap)."""

from __future__ import annotations

import pytest
import torch

from specgraft.backends import packed
from specgraft.core.backend import TargetBackend, head_rows, packed_layers

from ..conftest import assert_greedy_equal, tiny_llama

BF16_STEP = 2.0 ** -8  # one bf16 rounding of a value, relative


def assert_within_one_rounding(a: torch.Tensor, b: torch.Tensor) -> None:
    a, b = a.float(), b.float()
    assert float((a - b).abs().max()) <= BF16_STEP * float(b.abs().max())

pytestmark = pytest.mark.skipif(not packed.available(), reason="this PyTorch has no oneDNN linear ops, or this CPU "
                                "no packed bf16 path (AVX2 only: tests/backends/test_packed_fallback.py)")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_layer_equals_the_plain_layer_bit_for_bit(bias):
    torch.manual_seed(0)
    plain = torch.nn.Linear(96, 80, bias=bias).to(torch.bfloat16)
    layer = packed.PackedLinear(plain.weight, plain.bias)
    assert (layer.in_features, layer.out_features) == (96, 80)
    for rows in (1, 2, 3, 4, 7, 16):
        x = torch.randn(2, rows, 96).to(torch.bfloat16)
        y = layer(x)
        assert y.shape == (2, rows, 80) and y.dtype == torch.bfloat16
        assert_within_one_rounding(y, plain(x))
    # negative control: one weight moved by a few bf16 steps is seen
    w = plain.weight.detach().clone()
    w[5, 7] += 8 * w.abs().max()
    moved = packed.PackedLinear(w, plain.bias)
    x = torch.randn(4, 96).to(torch.bfloat16)
    with pytest.raises(AssertionError):
        assert_within_one_rounding(moved(x), plain(x))


def test_a_packed_model_gives_the_plain_models_logits_and_keeps_its_embedding():
    plain = tiny_llama(vocab=64, layers=2).to(torch.bfloat16)
    model = tiny_llama(vocab=64, layers=2).to(torch.bfloat16)
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
    model = tiny_llama(vocab=64, layers=1).to(torch.bfloat16)
    plain_runtime = TargetBackend(model).capabilities.runtime
    assert "prepacked" not in plain_runtime
    packed.prepack(model)
    assert TargetBackend(model).capabilities.runtime == plain_runtime + "|prepacked"
    monkeypatch.setenv("SPECGRAFT_PREPACK", "0")  # the switch for measuring plain layers
    assert not packed.available() and packed.prepack(tiny_llama(layers=1).to(torch.bfloat16)) == []


def test_fp32_models_are_left_as_they_are():
    model = tiny_llama(layers=1)  # the exactness reference stays on the plain fp32 kernels
    assert packed.prepack(model) == [] and packed_layers(model) == 0


@pytest.mark.slow
def test_smollm2_bf16_loads_packed_and_decodes_as_the_plain_model(monkeypatch):
    from specgraft import Engine

    fast = Engine("smollm2-135m", "bfloat16")
    assert "prepacked" in fast.capabilities.runtime
    assert isinstance(fast.backend.model.get_output_embeddings(), packed.PackedLinear)
    monkeypatch.setenv("SPECGRAFT_PREPACK", "0")
    plain = Engine("smollm2-135m", "bfloat16")
    assert "prepacked" not in plain.capabilities.runtime
    prompt = "Write a Python function that removes duplicates from a list."
    gap = plain.capabilities.tie_gap
    for method in ("ar", "pld"):
        ref = plain.generate(prompt, method, max_new_tokens=32)
        assert_greedy_equal(plain, ref, fast.generate(prompt, method, max_new_tokens=32), f"packed {method}", gap=gap)
