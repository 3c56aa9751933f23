"""bf16 linear layers prepacked for oneDNN (``backends/packed.py``): a packed layer must compute what the plain
layer computes (the same kernel on the same bf16 values, so bit for bit at tree widths), a packed model must give
the plain model's logits and greedy text, a tied head must get its own copy without touching the embedding, and
the cost curve's key must tell packed from plain layers."""

from __future__ import annotations

import pytest
import torch

from specgraft.backends import packed
from specgraft.core.backend import TargetBackend, head_rows, packed_layers

from ..conftest import tiny_llama

pytestmark = pytest.mark.skipif(not packed.available(), reason="this PyTorch has no oneDNN linear ops")


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
        assert torch.equal(y, plain(x)), rows
    # negative control: one weight moved by a few bf16 steps is seen
    w = plain.weight.detach().clone()
    w[5, 7] += 8 * w.abs().max()
    moved = packed.PackedLinear(w, plain.bias)
    x = torch.randn(4, 96).to(torch.bfloat16)
    assert not torch.equal(moved(x), plain(x))


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
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    # through the backend: a tree verify after a prefill, packed against plain
    from specgraft.core.tree import Tree

    outs = []
    for m in (model, plain):
        be = TargetBackend(m)
        be.prefill(ids[0])
        outs.append(be.verify(Tree.chain(int(ids[0, -1]), [3, 4, 5, 6])).logits)
    assert torch.equal(*outs)


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
    a = fast.generate(prompt, "ar", max_new_tokens=32)
    assert a.token_ids == plain.generate(prompt, "ar", max_new_tokens=32).token_ids
    b = fast.generate(prompt, "pld", max_new_tokens=32)
    assert b.token_ids == plain.generate(prompt, "pld", max_new_tokens=32).token_ids
