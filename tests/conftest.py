import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(vocab: int = 16, layers: int = 2, seed: int = 0, scale: float = 1.0) -> LlamaForCausalLM:
    """A random tiny Llama in fp32; ``scale`` sharpens the output distribution."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=0, eos_token_id=vocab - 1, pad_token_id=0, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def smollm2_engine():
    """SmolLM2-135M-Instruct in fp32 (the exactness reference); converted once into the user cache."""
    from specgraft import Engine

    return Engine("smollm2-135m", "float32")
