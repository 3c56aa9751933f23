"""EAGLE-3 checkpoint format: a synthetic official checkpoint loads, save/load round-trips, mismatches refused."""

import json

import pytest
import torch

from specgraft.errors import SpecgraftError
from specgraft.eagle.checkpoint import load_head, save_head

from ..conftest import tiny_llama
from ..eagle.test_head import random_head


def official_checkpoint(path, target, hidden=32, vocab=16, draft=8, layers=1, fmt="bin", arch="LlamaForCausalLM"):
    """Written the way EAGLE's own scripts lay it out: Llama config, pytorch_model.bin, d2t/t2d, no embedding."""
    torch.manual_seed(3)
    H, nh, nkv, d, inter = hidden, 4, 2, hidden // 4, 40
    state = {
        "fc.weight": torch.randn(H, 3 * H), "norm.weight": torch.rand(H) + 0.5,
        "lm_head.weight": torch.randn(draft, H),
        "midlayer.input_layernorm.weight": torch.rand(H) + 0.5, "midlayer.hidden_norm.weight": torch.rand(H) + 0.5,
        "midlayer.post_attention_layernorm.weight": torch.rand(H) + 0.5,
        "midlayer.self_attn.q_proj.weight": torch.randn(nh * d, 2 * H) * 0.1,
        "midlayer.self_attn.k_proj.weight": torch.randn(nkv * d, 2 * H) * 0.1,
        "midlayer.self_attn.v_proj.weight": torch.randn(nkv * d, 2 * H) * 0.1,
        "midlayer.self_attn.o_proj.weight": torch.randn(H, nh * d) * 0.1,
        "midlayer.mlp.gate_proj.weight": torch.randn(inter, H) * 0.1,
        "midlayer.mlp.up_proj.weight": torch.randn(inter, H) * 0.1,
        "midlayer.mlp.down_proj.weight": torch.randn(H, inter) * 0.1,
    }
    ids = torch.tensor([0, 2, 3, 5, 7, 11, 13, 15][:draft])
    state["d2t"] = ids - torch.arange(draft)
    state["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    state["t2d"][ids] = True
    cfg = {"architectures": [arch], "model_type": "llama", "hidden_size": H, "intermediate_size": inter,
           "num_attention_heads": nh, "num_key_value_heads": nkv, "num_hidden_layers": layers, "vocab_size": vocab,
           "draft_vocab_size": draft, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
           "hidden_act": "silu", "torch_dtype": "float16"}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if fmt == "bin":
        torch.save(state, path / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file
        save_file(state, str(path / "model.safetensors"))
    return state


def test_official_checkpoint_loads(tmp_path):
    target = tiny_llama(vocab=16, layers=4)
    state = official_checkpoint(tmp_path / "h", target)
    head = load_head(tmp_path / "h", target)
    assert head.config.target_layers == (2, 2, 1)  # (2, L//2, L-3) for L = 4
    torch.testing.assert_close(head.fc.weight, state["fc.weight"])
    torch.testing.assert_close(head.embed_tokens.weight, target.model.embed_tokens.weight)
    assert head.to_target(torch.arange(8)).tolist() == [0, 2, 3, 5, 7, 11, 13, 15]
    assert head.t2d.dtype == torch.bool and head.d2t.dtype == torch.long


def test_specforge_safetensors_and_roundtrip(tmp_path):
    target = tiny_llama(vocab=16, layers=4)
    official_checkpoint(tmp_path / "h", target, fmt="safetensors", arch="LlamaForCausalLMEagle3")
    head = load_head(tmp_path / "h", target)
    save_head(head, tmp_path / "out", dtype=torch.float32)
    again = load_head(tmp_path / "out", target)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    x, tok = torch.randn(1, 5, 32), torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        a, _ = head.step(x, tok, torch.arange(5).unsqueeze(0), None, None)
        b, _ = again.step(x, tok, torch.arange(5).unsqueeze(0), None, None)
    torch.testing.assert_close(a, b)
    assert torch.equal(head.d2t, again.d2t) and torch.equal(head.t2d, again.t2d)


def test_trained_style_head_roundtrip_in_bf16(tmp_path):
    target = tiny_llama(vocab=16, layers=4)
    head = random_head(target, [1, 4, 5, 15])
    save_head(head, tmp_path / "bf16")
    loaded = load_head(tmp_path / "bf16", target, torch.float32)
    torch.testing.assert_close(loaded.lm_head.weight, head.lm_head.weight.bfloat16().float())
    assert loaded.config.draft_vocab_size == 4


@pytest.mark.parametrize("kw, message", [
    ({"hidden": 48}, "hidden_size is 48 in the head, 32 in the target"),
    ({"vocab": 20}, "vocab_size is 20 in the head, 16 in the target"),
    ({"layers": 2}, "has 2 layers; EAGLE-3 heads have exactly 1"),
    ({"arch": "MistralForCausalLM"}, "is not an EAGLE-3 head"),
])
def test_mismatched_head_is_refused(tmp_path, kw, message):
    target = tiny_llama(vocab=16, layers=4)
    official_checkpoint(tmp_path / "h", target, **kw)
    with pytest.raises(SpecgraftError, match=message):
        load_head(tmp_path / "h", target)


def test_missing_or_broken_head_is_refused(tmp_path):
    target = tiny_llama(vocab=16, layers=4)
    with pytest.raises(SpecgraftError, match="not found"):
        load_head(tmp_path / "nope", target)
    official_checkpoint(tmp_path / "h", target)
    state = torch.load(tmp_path / "h" / "pytorch_model.bin")
    del state["fc.weight"]
    torch.save(state, tmp_path / "h" / "pytorch_model.bin")
    with pytest.raises(SpecgraftError, match=r"lacks weights \['fc.weight'\]"):
        load_head(tmp_path / "h", target)
