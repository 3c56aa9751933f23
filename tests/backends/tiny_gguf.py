"""A tiny transformers Llama written as an fp32 GGUF, so the llama.cpp backend runs the very weights whose exact
distributions the transformers tests enumerate (its logits agree to ~1e-4: llama.cpp keeps the KV cache in f16)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF Llama rotates halves of each head (NeoX order); llama.cpp's ``llama`` architecture rotates adjacent
    pairs, so q/k rows are interleaved the way llama.cpp's own converter does."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model, path: Path) -> Path:
    """Write ``model`` (a ``LlamaForCausalLM``, untied head) to ``path`` with a placeholder vocabulary of
    ``vocab_size`` tokens (token ids are used directly: no text goes through it)."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or 10000.0))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = cfg.vocab_size
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(vocab - 3)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([2, 3, 3] + [1] * (vocab - 3))  # unknown, control, control, normal...
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"blk.{i}."
        for hf, ours in (("input_layernorm", "attn_norm"), ("self_attn.v_proj", "attn_v"),
                         ("self_attn.o_proj", "attn_output"), ("post_attention_layernorm", "ffn_norm"),
                         ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")):
            writer.add_tensor(f"{dst}{ours}.weight", sd[f"{src}{hf}.weight"])
        writer.add_tensor(f"{dst}attn_q.weight", _rope_permute(sd[f"{src}self_attn.q_proj.weight"],
                                                                cfg.num_attention_heads))
        writer.add_tensor(f"{dst}attn_k.weight", _rope_permute(sd[f"{src}self_attn.k_proj.weight"],
                                                                cfg.num_key_value_heads))
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    writer.add_tensor("output.weight", sd["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
