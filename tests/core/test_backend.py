import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from specgraft.core.backend import TargetBackend
from specgraft.errors import SpecgraftError
from specgraft.core.tree import Tree

from ..conftest import tiny_llama


def sequential_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def test_tree_logits_equal_sequential_per_path(tiny_model):
    backend = TargetBackend(tiny_model)
    prompt = [1, 5, 7, 2, 9]
    backend.prefill(torch.tensor(prompt))
    tree = Tree.build([3, 4, 6, 8, 10, 11, 4], [-1, 0, 0, 1, 1, 3, 2])
    out = backend.verify(tree)
    assert out.logits.shape == (7, 16)
    toks = tree.tokens.tolist()
    for node in range(tree.size):
        path = []
        n = node
        while n != -1:
            path.append(toks[n])
            n = tree.parent_list[n]
        ref = sequential_logits(tiny_model, prompt + path[::-1])
        assert torch.allclose(out.logits[node], ref, atol=1e-4), node


def test_commit_compacts_to_the_accepted_path(tiny_model):
    backend = TargetBackend(tiny_model)
    prompt = [1, 5, 7]
    backend.prefill(torch.tensor(prompt))
    tree = Tree.build([3, 4, 6, 8, 10], [-1, 0, 0, 2, 3])
    backend.verify(tree)
    backend.commit([0, 2, 3])  # root 3, then 6, 8 (non-contiguous slots)
    assert backend.prefix_len == 6
    assert backend.cache.get_seq_length() == 6
    out = backend.verify(Tree.chain(12, [13]))
    assert torch.allclose(out.logits[0], sequential_logits(tiny_model, prompt + [3, 6, 8, 12]), atol=1e-4)
    assert torch.allclose(out.logits[1], sequential_logits(tiny_model, prompt + [3, 6, 8, 12, 13]), atol=1e-4)
    backend.commit([0, 1])  # contiguous path: no copy needed
    out = backend.verify(Tree.chain(14, []))
    assert torch.allclose(out.logits[0], sequential_logits(tiny_model, prompt + [3, 6, 8, 12, 13, 14]), atol=1e-4)


def test_hidden_states_on_request(tiny_model):
    backend = TargetBackend(tiny_model)
    backend.prefill(torch.tensor([1, 2]))
    out = backend.verify(Tree.chain(3, [4, 5]), hidden_layers=(0, 2))
    assert set(out.hidden) == {0, 2} and out.hidden[2].shape == (3, 32)


def test_qwen2_architecture_verifies_trees():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = Qwen2ForCausalLM(cfg).eval()
    backend = TargetBackend(model)
    backend.prefill(torch.tensor([1, 2, 3]))
    out = backend.verify(Tree.build([4, 5, 6], [-1, 0, 0]))
    assert torch.allclose(out.logits[2], sequential_logits(model, [1, 2, 3, 4, 6]), atol=1e-4)


def test_sliding_window_models_are_refused():
    model = tiny_llama()
    model.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(SpecgraftError, match="sliding-window"):
        TargetBackend(model)
    model.config.layer_types = ["full_attention", "full_attention"]
