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


TIE_GAP = 1e-3  # logits closer than this are a tie that fp32 kernels of different shapes may break either way


def assert_greedy_equal(engine, ref, out, label="", gap: float = TIE_GAP) -> bool:
    """``out`` must equal the AR reference token for token; the only allowed difference is a first
    divergence at an exact tie of the reference logits (both tokens within ``gap`` of the max; bf16
    activations: the backend's declared ``tie_gap``), after which the sequences legitimately differ. Returns
    True when such a tie was met."""
    if out.token_ids == ref.token_ids:
        return False
    i = next((j for j, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b), None)
    assert i is not None, f"{label}: one output is a prefix of the other (lengths {len(ref.token_ids)}, " \
                          f"{len(out.token_ids)})"
    with torch.no_grad():
        ids = torch.tensor([ref.prompt_ids + ref.token_ids[:i]], device=engine.backend.device)
        logits = engine.backend.model(input_ids=ids).logits[0, -1].float().cpu()
    top = float(logits.max())
    a, b = float(logits[ref.token_ids[i]]), float(logits[out.token_ids[i]])
    assert top - a < gap and top - b < gap, \
        f"{label}: differs from AR at token {i} ({ref.token_ids[i]} vs {out.token_ids[i]}), not a tie: " \
        f"gaps {top - a:.2e}, {top - b:.2e}"
    return True


@pytest.fixture(scope="session")
def tiny_engine():
    """A tiny random Llama behind SmolLM2's real tokenizer and chat template: fast end-to-end runs."""
    from transformers import AutoTokenizer

    from specgraft import Engine, models

    tok = AutoTokenizer.from_pretrained(models.resolve("smollm2-135m"))
    model = tiny_llama(vocab=len(tok), layers=1, scale=8.0)
    with torch.no_grad():  # only the first 300 tokens can win: outputs repeat, so retrieval has work to do
        model.lm_head.weight[300:] = 0
    return Engine.from_model(model, tok, name="tiny-smollm2-vocab")
