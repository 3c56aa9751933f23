from types import SimpleNamespace

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa
from transformers import DynamicCache

from specgraft.core import attention
from specgraft.core.attention import NAME, PositionalLayer, grouped_sdpa, stock_attention, use_grouped_attention
from specgraft.core.backend import TargetBackend
from specgraft.core.tree import Tree

from ..conftest import tiny_llama

PROMPTS = [[1, 5, 7, 2, 9], [3, 4], [8, 6, 2, 11, 12, 13, 1]]
TREES = [Tree.build([3, 4, 6, 8, 10, 11, 4], [-1, 0, 0, 1, 1, 3, 2]), Tree.chain(9, [2]),
         Tree.build([5, 6, 7, 8], [-1, 0, 0, 1])]
ACCEPTED = [[0, 1, 3, 5], [0], [0, 2]]


def transformers_backend(model) -> TargetBackend:
    """The reference: transformers' own SDPA (``repeat_kv``) and ``DynamicCache``."""
    backend = TargetBackend(model)
    model.set_attn_implementation("sdpa")
    backend.new_cache = lambda config: DynamicCache(config=config)
    return backend


@pytest.fixture
def repeats(monkeypatch):
    """How many times transformers copied key/value heads per query head."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    original = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", counted)
    return calls


def run_steps(backend: TargetBackend) -> list[torch.Tensor]:
    """Three rows of different lengths: a step of trees, a commit, a row leaving, another step."""
    for prompt in PROMPTS:
        backend.add(torch.tensor(prompt))
    first = backend.verify_batch(TREES)
    backend.commit_batch(ACCEPTED)
    backend.remove(1)
    second = backend.verify_batch([TREES[1], TREES[0]])
    return [o.logits for o in first + second]


@pytest.mark.parametrize("mask_rows", [1, 3])
@pytest.mark.parametrize("boolean", [False, True])
def test_folded_heads_attend_as_repeated_heads(mask_rows, boolean):
    """6 query heads on 2 key/value heads (groups 3 != key/value heads 2), sharp scores, masks per row or shared."""
    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    q, k, v = torch.randn(3, 6, 5, 8) * 3, torch.randn(3, 2, 11, 8) * 3, torch.randn(3, 2, 11, 8)
    visible = torch.rand(mask_rows, 1, 5, 11) < 0.6
    visible[..., 0] = True  # every query sees something
    mask = visible if boolean else torch.zeros(mask_rows, 1, 5, 11).masked_fill_(~visible, float("-inf"))
    got, _ = grouped_sdpa(module, q, k, v, mask, scaling=0.5)
    want, _ = hf_sdpa.sdpa_attention_forward(module, q, k, v, mask, scaling=0.5)
    assert got.shape == want.shape == (3, 5, 6, 8)
    assert torch.allclose(got, want, atol=1e-5)


def test_grouped_attention_scores_batched_trees_as_transformers_does_without_copying_heads(repeats):
    ours = TargetBackend(tiny_llama(seed=3))
    assert ours.model.config._attn_implementation == NAME and "|grouped-sdpa" in ours.capabilities.runtime
    reference = transformers_backend(tiny_llama(seed=3))
    expected = run_steps(reference)
    assert repeats, "the reference path should copy heads (else this test shows nothing)"
    repeats.clear()
    got = run_steps(ours)
    assert not repeats
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, atol=1e-5)


def test_the_cache_is_written_in_place_until_it_runs_out_of_spare_columns(monkeypatch):
    monkeypatch.setattr(attention, "SPARE", 16)  # a 5-token prompt gets a 32-column buffer
    backend = TargetBackend(tiny_llama())
    backend.prefill(torch.tensor(PROMPTS[0]))
    layer = backend.cache.layers[0]
    assert isinstance(layer, PositionalLayer)
    start = layer.keys.data_ptr()
    for _ in range(11):  # the last step's 7-node tree fills columns 25-31
        backend.verify(TREES[0])
        backend.commit([0, 1])
    assert layer.keys.data_ptr() == start and layer._key_buf.shape[2] == 32
    assert layer.keys.shape[2] == backend.prefix_len == len(PROMPTS[0]) + 22
    for _ in range(29):  # past the spare columns: new buffers, the prefix copied into each
        backend.verify(TREES[0])
        backend.commit([0, 1])
    assert layer._key_buf.shape[2] > 32 and layer.keys.shape[2] == backend.prefix_len == len(PROMPTS[0]) + 80
    reference = transformers_backend(tiny_llama())
    reference.prefill(torch.tensor(PROMPTS[0]))
    for _ in range(40):
        reference.verify(TREES[0])
        reference.commit([0, 1])
    assert torch.allclose(backend.verify(TREES[2]).logits, reference.verify(TREES[2]).logits, atol=1e-5)


def test_models_without_grouped_heads_or_on_another_attention_are_left_alone():
    eager = tiny_llama()
    eager.set_attn_implementation("eager")
    assert not use_grouped_attention(eager) and eager.config._attn_implementation == "eager"
    assert "grouped" not in TargetBackend(eager).capabilities.runtime
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa")
    assert not use_grouped_attention(LlamaForCausalLM(cfg))


def test_the_outside_reference_runs_stock_attention_and_ours_comes_back():
    model = tiny_llama()
    TargetBackend(model)
    with stock_attention(model):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == NAME
